"""schedule/room.py against a plain reference: the arrays place every short document where the plain
visit of every (round, rank) cell does (rule 4 of schedule/rounds.py, ties included)."""
import random

import pytest

from ds_seqpar.schedule import Group, MicroBatch, group_sizes, schedule
from ds_seqpar.schedule import rounds


class PlainPlacer:
    """Every cell visited: options (busiest load after, kind, round, rank), the least taken."""

    def __init__(self, table, load, t, total, pricer, fill_groups):
        self.table, self.load, self.t, self.total = table, list(load), t, total
        self.pricer, self.fill = pricer, fill_groups

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


@pytest.mark.parametrize("fill", [True, False])
def test_the_arrays_place_short_documents_as_the_plain_visit_does(monkeypatch, fill):
    rng, cases = random.Random(7), 0
    for _ in range(120):
        world, t = rng.choice([1, 2, 4, 8, 16]), rng.choice([16, 64, 100, 400])
        lengths = [rng.choice([rng.randint(1, t), rng.randint(1, world * t)]) for _ in range(rng.randint(1, 50))]
        sizes = rng.choice([group_sizes(world), (1,), group_sizes(world)[:2]])
        if max(lengths) > max(sizes) * t:
            continue
        fast = schedule(lengths, world, t, sizes, fill_groups=fill)
        with monkeypatch.context() as m:
            m.setattr(rounds, "ShortPlacer", PlainPlacer)
            plain = schedule(lengths, world, t, sizes, fill_groups=fill)
        assert _key(fast) == _key(plain), (world, t, sizes, lengths)
        cases += 1
    assert cases > 60
