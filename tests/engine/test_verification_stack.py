"""Verification groups read their rows' logits as one block: a view where the rows lie back
to back in the forward's logits, a stacked copy otherwise; both equal torch.stack. Greedy
rows take one argmax over all of them and agree with the rejection sampler."""

from __future__ import annotations

import torch

from specmoe.engine.verification import VerifyRow, _flat, _stack, verify_rows
from specmoe.sample.ops import SamplingTensors
from specmoe.sample.rejection_sampler import rejection_sample
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


def _rejection_reference(row: VerifyRow):
    """`rejection_sample` on one row: the sampler the greedy path must agree with."""
    out = rejection_sample(row.logits[None], torch.tensor([row.draft_token_ids], dtype=torch.long).view(1, -1),
                           None, SamplingTensors.from_params([row.params]), [None])
    n = int(out.num_accepted[0])
    return out.output_token_ids[0, :n + 1].tolist(), n


def test_greedy_rows_verify_as_the_rejection_sampler_does():
    gen = torch.Generator().manual_seed(0)
    for case in range(200):
        ks = torch.randint(0, 5, (int(torch.randint(1, 7, (1,), generator=gen)),),
                           generator=gen).tolist()
        vocab = 3 if case % 2 else 40  # few tokens: ties and long accepted runs
        logits = torch.randn(sum(ks) + len(ks), vocab, generator=gen)
        if case % 5 == 0:
            logits[0, 1] = float("nan")
        rows, offset = [], 0
        for k in ks:
            block = logits[offset:offset + k + 1]
            offset += k + 1
            drafts = block[:k].argmax(-1).tolist()
            cut = int(torch.randint(0, k + 1, (1,), generator=gen))
            if cut < k:  # a wrong draft at `cut` (the rest stay the argmax)
                drafts[cut] = (drafts[cut] + 1) % vocab
            rows.append(VerifyRow(block, drafts, None, SamplingParams(temperature=0.0), None))
        results = verify_rows(rows)
        copies = verify_rows([VerifyRow(r.logits.clone(), r.draft_token_ids, None, r.params, None)
                              for r in rows])
        assert results == copies
        for row, result in zip(rows, results):
            assert (result.token_ids, result.num_accepted) == _rejection_reference(row)


def test_flat_is_a_view_of_back_to_back_rows_of_any_length():
    logits = torch.randn(7, 30)
    rows = _rows([logits[:1], logits[1:4], logits[4:]])
    assert _flat(rows).data_ptr() == logits.data_ptr() and torch.equal(_flat(rows), logits)
    gap = _rows([logits[:1], logits[2:4]])
    assert torch.equal(_flat(gap), torch.cat([logits[:1], logits[2:4]]))
    assert _flat(gap).data_ptr() != logits.data_ptr()
