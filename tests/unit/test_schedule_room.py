"""schedule/room.py against a plain reference: the arrays place every short document where the plain
visit of every (round, rank) cell does (rule 4 of schedule/rounds.py, ties included)."""
import random

import pytest

from ds_seqpar.schedule import Group, MicroBatch, group_sizes, schedule
from ds_seqpar.schedule import rounds


class PlainPlacer:
    """Every cell visited: options (busiest load after, kind, round, rank), the least taken."""

    def __init__(self, table, load, t, total, pricer, fill_groups, round_price=None):
        self.table, self.load, self.t, self.total = table, list(load), t, total
        self.pricer, self.fill, self.round_price = pricer, fill_groups, round_price

    def place(self, d, lengths):
        n, best, world = lengths[d], None, len(self.load)
        for k, row in enumerate(self.table):
            for r in range(world):
                mb = row.get(r)
                if mb is None:
                    option = (self.load[r] + self.pricer(n, 1), 1, k, r)
                elif mb.tokens + n > mb.group.size * self.t or (mb.group.size > 1 and (r != mb.group.first
                                                                                        or not self.fill)):
                    continue
                elif mb.group.size == 1:
                    option = (self.load[r] + self.pricer(n, 1), 0, k, r)
                else:
                    option = (max(self.load[x] for x in mb.group.ranks) + self.pricer(n, mb.group.size), 2, k, r)
                best = option if best is None or option < best else best
        full = all(len(row) == world for row in self.table)
        if best is not None and self.round_price is not None and full and \
                best[0] - (min(self.load) + self.pricer(n, 1)) > self.round_price:
            best = None                     # a fresh round balances by more than it costs
        if best is None:
            self.table.append({})
            best = (0.0, 1, len(self.table) - 1, min(range(world), key=lambda x: (self.load[x], x)))
        _, _, k, r = best
        mb = self.table[k].get(r)
        docs = tuple(sorted((mb.documents if mb else ()) + (d,)))
        group = mb.group if mb else Group(1, r)
        added = self.pricer(n, group.size)
        new = MicroBatch(group, docs, tuple(lengths[i] for i in docs), self.total, (mb.cost if mb else 0.0) + added)
        for x in group.ranks:
            self.table[k][x] = new
            self.load[x] += added


def _key(s):
    return [[(mb.group.size, mb.group.first, mb.documents, mb.cost) for mb in row] for row in s.rounds], s.rank_costs


@pytest.mark.parametrize("fill, round_price", [(True, None), (False, None), (True, 0.0), (True, 50.0)])
def test_the_arrays_place_short_documents_as_the_plain_visit_does(monkeypatch, fill, round_price):
    rng, cases = random.Random(7), 0
    for _ in range(120):
        world, t = rng.choice([1, 2, 4, 8, 16]), rng.choice([16, 64, 100, 400])
        lengths = [rng.choice([rng.randint(1, t), rng.randint(1, world * t)]) for _ in range(rng.randint(1, 50))]
        sizes = rng.choice([group_sizes(world), (1,), group_sizes(world)[:2]])
        if max(lengths) > max(sizes) * t:
            continue
        fast = schedule(lengths, world, t, sizes, fill_groups=fill, round_price=round_price)
        with monkeypatch.context() as m:
            m.setattr(rounds, "ShortPlacer", PlainPlacer)
            plain = schedule(lengths, world, t, sizes, fill_groups=fill, round_price=round_price)
        assert _key(fast) == _key(plain), (world, t, sizes, lengths)
        cases += 1
    assert cases > 60


def test_a_round_for_balance_when_room_alone_would_overload_a_rank():
    """2 ranks, T = 10, attention-like prices (n^2): 7 goes to rank 0, the 4s fill rank 1 (8 tokens),
    and 3 fits only beside the 7. Room alone puts it there (58 against 32); with round_price=0 a second
    round takes it on rank 1 (49 against 41); a round dearer than that gain (9) is not bought."""
    price = lambda n, g: float(n * n) / g        # noqa: E731
    lengths = [4, 3, 4, 7]
    packed = schedule(lengths, 2, 10, (1,), pricer=price)
    assert (len(packed.rounds), packed.rank_costs) == (1, (58.0, 32.0))
    balanced = schedule(lengths, 2, 10, (1,), pricer=price, round_price=0.0)
    assert (len(balanced.rounds), balanced.rank_costs) == (2, (49.0, 41.0))
    assert schedule(lengths, 2, 10, (1,), pricer=price, round_price=17.0).rank_costs == (58.0, 32.0)
