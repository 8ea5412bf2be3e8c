"""Verification groups read their rows' logits as one block: a view where the rows lie back
to back in the forward's logits, a stacked copy otherwise; both equal torch.stack."""

from __future__ import annotations

import torch

from specmoe.engine.verification import VerifyRow, _stack, verify_rows
from specmoe.sampling_params import SamplingParams


def _rows(tensors, k=0):
    return [VerifyRow(t, [0] * k, None, SamplingParams(temperature=0.0), None) for t in tensors]


def test_back_to_back_rows_are_a_view():
    logits = torch.randn(6, 50)
    for k in (0, 1):  # [1, V] rows (plain), [2, V] rows (one draft)
        rows = _rows(logits.split(k + 1), k)
        block = _stack(rows)
        assert block.data_ptr() == logits.data_ptr()
        assert torch.equal(block, torch.stack([r.logits for r in rows]))
        assert block.stride() == torch.stack([r.logits for r in rows]).stride()


def test_other_layouts_are_copied_and_equal_torch_stack():
    logits = torch.randn(6, 50)
    parts = logits.split(1)
    cases = [[parts[0], parts[2]],                   # a gap
             [parts[1], parts[0]],                   # reversed
             [parts[0], parts[0]],                   # one slice twice
             [parts[0], torch.randn(1, 50)],          # another tensor
             [logits[:2, ::2], logits[2:4, ::2]],     # non-contiguous rows
             [parts[0], parts[1].view(torch.int32)]]  # another dtype on the same storage
    for tensors in cases[:-1]:
        block = _stack(_rows(tensors))
        assert block.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr()
        assert torch.equal(block, torch.stack(tensors))
    block = _stack(_rows(cases[-1]))  # stacked, promoted as torch does
    assert block.dtype == torch.float32 and torch.equal(block, torch.stack(cases[-1]))


def test_verify_rows_tokens_do_not_depend_on_the_layout():
    logits = torch.randn(8, 2, 70)
    flat = logits.reshape(16, 70)
    drafts = logits[:, 0].argmax(-1)
    view_rows = [VerifyRow(t, [int(d)], None, SamplingParams(temperature=0.0), None)
                 for t, d in zip(flat.split(2), drafts)]
    copy_rows = [VerifyRow(t.clone(), r.draft_token_ids, None, r.params, None)
                 for t, r in zip(flat.split(2), view_rows)]
    assert verify_rows(view_rows) == verify_rows(copy_rows)
