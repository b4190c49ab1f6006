"""bench.memory: bytes counted from the optimizer objects against hand-computed ones, the resident-memory
peak it measures, and the per-GPU arithmetic of its tables."""
from __future__ import annotations

import pytest
import torch

import slamb
from bench import memory


def tiny():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(100, 120), torch.nn.Linear(120, 40))
    return list(model.parameters())  # 12,000 + 120 + 4,800 + 40 = 16,960 entries


def stepped(name, params, **kw):
    opt = slamb.create_optimizer(name, params, lr=1e-3, **kw)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return opt


def test_lamb_state_is_two_fp32_words_per_parameter_and_no_scratch():
    params = tiny()
    got = memory.counted_bytes(stepped("lamb", params), params)
    # exp_avg and exp_avg_sq (2 x 4 bytes per entry) and a 4-byte step counter per tensor
    assert got == {"state": 2 * 4 * 16_960 + 4 * 4, "scratch": 0}


def test_slamb_state_is_counted_once_through_its_flat_buffers():
    """SLAMB's per-tensor state is views into flat buffers: each buffer counts once. m, v and an int16 age
    (v1: steps since averaged; v2: the same, r = b3^age): 2.5 fp32 words per entry. Scratch holds at least
    the update buffers (two fp32 words per entry: the direction and r, or v1's two) plus the mask's
    buffers (under a word), and never the parameters or gradients."""
    for variant, state, work in (("v2", 2 * 4 * 16_960 + 2 * 16_960, 2 * 4 * 16_960),
                                 ("v1", 2 * 4 * 16_960 + 2 * 16_960, 2 * 4 * 16_960)):
        params = tiny()
        got = memory.counted_bytes(stepped("slamb", params, variant=variant, min_compress_numel=1000), params)
        assert got["state"] == state
        assert work <= got["scratch"] < work + 4 * 16_960
    # the fused path: the same 2.5 words (its age in fp16; state_dict() saves an int16 copy, not held), no
    # update buffers
    params = tiny()
    got = memory.counted_bytes(stepped("slamb", params, variant="v2", min_compress_numel=1000, fused=True), params)
    assert got["state"] == 2 * 4 * 16_960 + 2 * 16_960
    assert got["scratch"] < 4 * 16_960


def test_resident_peak_sees_a_freed_temporary():
    res = memory.Resident()
    res.reset()
    before = res.now()
    t = torch.ones(16 * 2**20)  # 64 MiB, above glibc's largest mmap threshold: handed back when freed
    del t
    assert res.peak() - before >= 60 * 2**20
    assert res.now() - before < 8 * 2**20
    res.reset()
    assert res.peak() - res.now() < 8 * 2**20


def test_per_gpu_bytes_and_fit():
    per = {"state": 12.0, "scratch": 4.0, "first": 6.0, "later": 2.0, "resume": 14.0, "ddp": True,
           "bucket_view": False, "numel": [52_000_000, 107_000_000]}
    b = memory.model_bytes(per, 10**9)
    assert (b["params"], b["grads"], b["buckets"]) == (4e9, 4e9, 4e9)
    assert b["resident"] == 28e9 and b["resume"] == 42e9 and b["fwd_bwd"] == 30e9
    assert b["peak"] == 42e9 and b["fits"]
    viewed = memory.model_bytes({**per, "bucket_view": True}, 3 * 10**9)
    assert viewed["buckets"] == 0 and viewed["peak"] == 3 * 38e9 and not viewed["fits"]
    page = memory.render({"slamb_v2": per}, {"BERT-Large": 336_232_258, "BERT-XL": 2_767_626_050})
    assert "| slamb_v2 | 1.3 | 1.3 | 1.3 | 4.0 | 1.3 | 9.4 |" in page  # BERT-Large in GB
    assert "BERTs of 52M and 107M parameters" in page
    fixed = memory.model_bytes({**per, "scratch_fixed": 84e6}, 10**9)  # a bounded buffer: charged once
    assert fixed["scratch"] == 4e9 + 84e6 and fixed["resident"] == 28e9 + 84e6
    assert "no (" in page.split("## BERT-XL")[1] and "yes (" in page.split("## BERT-XL")[0]


def test_rows_include_fused_slamb():
    assert set(memory.rows()) == {"lamb", "onebit_lamb", "slamb_v2", "slamb_v1", "slamb_v2_fused", "slamb_v1_fused"}


def test_two_rank_measurement_of_the_real_optimizers():
    """The page's measuring run on a tiny BERT in a 2-rank gloo group: state per parameter as counted
    above, DDP's bucket view read from the DDP that wrap_model builds, transients that are not negative."""
    from transformers import BertConfig, BertForPreTraining

    tiny_bert = dict(vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, max_position_embeddings=64, type_vocab_size=2)
    tensors = len(list(BertForPreTraining(BertConfig(**tiny_bert)).parameters()))
    wider = {**tiny_bert, "hidden_size": 64, "intermediate_size": 128}
    wider_tensors = len(list(BertForPreTraining(BertConfig(**wider)).parameters()))
    assert wider_tensors == tensors
    got = memory.measure_rows(["lamb", "slamb_v2"], (tiny_bert, wider))
    assert got["lamb"]["state"] == pytest.approx(8.0)  # m, v per parameter ...
    assert got["lamb"]["state_fixed"] == pytest.approx(4 * tensors)  # ... and a step counter per tensor
    assert got["slamb_v2"]["state"] == pytest.approx(10.0)  # m, v and an int16 age
    assert got["slamb_v2"]["state_fixed"] == pytest.approx(0.0, abs=1e-6)
    assert got["slamb_v2"]["scratch"] >= 8.0  # its update buffers at least
    for row in got.values():  # the line goes through what was measured at both sizes
        for n, measured in zip(row["numel"], row["measured"]):
            b = memory.model_bytes(row, n)
            assert b["state"] == pytest.approx(measured["state"]) and b["scratch"] == pytest.approx(measured["scratch"])
            assert b["resume"] - b["resident"] == pytest.approx(measured["resume"])
    assert got["slamb_v2"]["bucket_view"] is True  # DDP sends nothing for SLAMB: no bucket copy of the gradients
    for row in got.values():
        assert row["ddp"] is True and isinstance(row["bucket_view"], bool)
        for measured in row["measured"]:  # peaks above the resident memory, at each size
            assert min(measured["first"], measured["later"], measured["resume"]) >= 0
