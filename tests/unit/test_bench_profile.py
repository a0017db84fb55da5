"""`bench.train_step.step_profile` sorts a step's self CPU time into kinds of work."""

import torch

from bench.train_step import PROFILE_ROWS, step_profile


def test_step_profile_rows_add_up_and_find_the_head() -> None:
    vocab = 997  # no other operand has this size
    hidden, head = torch.randn(64, 32), torch.randn(vocab, 32)
    a, b = torch.randn(8, 16, 16), torch.randn(8, 16, 16)
    system = torch.eye(16) + torch.randn(16, 16).tril(-1)

    def step() -> float:
        logits = hidden @ head.t()
        products = torch.bmm(a, b)
        solved = torch.linalg.solve_triangular(system, b[0], upper=False)
        return (logits.exp().sum() + products.sum() + solved.sum()).item()

    seconds = step_profile(step, vocab)
    assert list(seconds) == list(PROFILE_ROWS)
    parts = ["matrix products", "triangular solves", "attention", "everything else"]
    assert abs(sum(seconds[p] for p in parts) - seconds["step (self time)"]) < 1e-9
    assert 0 < seconds["  of which the LM head"] < seconds["matrix products"]  # bmm is not
    assert seconds["triangular solves"] > 0
    assert seconds["attention"] == 0
    assert seconds["everything else"] > 0  # exp, sums, item
