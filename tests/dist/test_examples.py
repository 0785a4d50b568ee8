"""examples/own_loop.py, the README's own-loop recipe, run on the pool's 4 ranks (2 data x 2
sequence, zigzag, ZeRO-2): each replica's loss is one process's loss on its row, step after step
(AdamW from the same initial weights on the mean over both rows, global-norm clipping at 1)."""
import importlib.util
import os

import torch
import torch.nn.functional as F

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "own_loop.py")
STEPS = 2


def _example():
    spec = importlib.util.spec_from_file_location("own_loop_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_example():
    return _example().main(steps=STEPS)


def _one_process():
    """The same model, optimizer and clipping in one process over both rows: each row's loss per step."""
    ex = _example()
    torch.manual_seed(0)
    model = ex.TinyLM(ex.plain_attention)
    opt = torch.optim.AdamW(model.parameters(), lr=ex.DS_CONFIG["optimizer"]["params"]["lr"])
    per_row = [[] for _ in range(ex.ROWS)]
    for step in range(STEPS):
        ids = ex.rows(step)
        logits = model(ids, torch.arange(ids.shape[1]).expand_as(ids))
        losses = [F.cross_entropy(logits[r, :-1], ids[r, 1:]) for r in range(ex.ROWS)]
        for r, loss in enumerate(losses):
            per_row[r].append(loss.item())
        opt.zero_grad()
        torch.stack(losses).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), ex.DS_CONFIG["gradient_clipping"])
        opt.step()
    return per_row


def test_own_loop_example_trains_like_one_process(pool):
    want = _one_process()
    for rank, (row, losses) in enumerate(pool.run(_run_example)):
        # step 1 is a forward of the same weights: fp32 summation order only. Later steps pass
        # through AdamW, whose first update is about lr x sign(gradient): a gradient element that is
        # rounding noise may flip, moving a weight by up to 2 lr, so the bound is looser there.
        assert abs(losses[0] - want[row][0]) <= 1e-5 * want[row][0], f"rank {rank} step 1: {losses} vs {want[row]}"
        for step in range(1, STEPS):
            assert abs(losses[step] - want[row][step]) <= 1e-3 * want[row][step], \
                f"rank {rank} step {step + 1}: {losses} vs {want[row]}"
