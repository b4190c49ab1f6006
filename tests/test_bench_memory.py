"""bench.memory: bytes counted from the optimizer objects against hand-computed ones, the resident-memory
peak it measures, and the per-GPU arithmetic of its tables."""
from __future__ import annotations

import gc

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
    # the fused path: the same 2.5 words per entry of its aligned layout (4 tensors, each padded to a multiple
    # of 256 entries: 17,408), no update buffers; its flat parameters and gradients are the parameters'
    params = tiny()
    got = memory.counted_bytes(stepped("slamb", params, variant="v2", min_compress_numel=1000, fused=True), params)
    assert got["state"] == 2 * 4 * 17_408 + 2 * 17_408
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


def _fit():
    """A fit of the form activation_fit returns: 100 h + 16 per layer, 12 h + 366,000 for the head, per token."""
    points = [{"hidden": h, "layers": layers, "numel": 10**6, "fixed": 0.0,
               "per_token": layers * (100 * h + 16) + 12 * h + 366_000} for h, layers in memory.ACT_SIZES]
    return {"a": 100.0, "c": 16.0, "f": 12.0, "g": 366_000.0, "seq": 128, "points": points}


def test_per_gpu_bytes_and_fit():
    per = {"state": 12.0, "scratch": 4.0, "first": 6.0, "later": 2.0, "resume": 14.0, "rebuild": 4.0, "eval": 5.0,
           "clone": 4.0, "first_host": 20.0, "resume_host": 12.0, "ddp": True, "bucket_view": False,
           "numel": [52_000_000, 107_000_000]}
    b = memory.model_bytes(per, 10**9)
    assert (b["params"], b["grads"], b["buckets"]) == (4e9, 4e9, 4e9)
    assert b["resident"] == 28e9 and b["resume"] == 42e9 and b["fwd_bwd"] == 30e9 and b["eval"] == 33e9
    assert b["rebuild"] == 34e9 and b["peak"] == 42e9 and b["fits"]
    # v1's cut and the loaded state are host memory: 20 bytes per parameter per rank, never in the GPU's peak
    assert b["host"] == 20e9
    assert b["peak"] == memory.model_bytes({**per, "first_host": 0.0, "resume_host": 0.0}, 10**9)["peak"]
    acts = memory.model_bytes(per, 10**9, 30e9)  # activations: added to the forward and backward, not to a step
    assert acts["training"] == 60e9 and acts["rebuild"] == 64e9 and acts["peak"] == 64e9 and acts["fits"]
    assert acts["fwd_bwd"] == b["fwd_bwd"] and acts["resume"] == b["resume"]
    viewed = memory.model_bytes({**per, "bucket_view": True}, 3 * 10**9)
    assert viewed["buckets"] == 0 and viewed["peak"] == 3 * 38e9 and not viewed["fits"]
    fixed = memory.model_bytes({**per, "scratch_fixed": 84e6}, 10**9)  # a bounded buffer: charged once
    assert fixed["scratch"] == 4e9 + 84e6 and fixed["resident"] == 28e9 + 84e6
    # largest micro-batch: the second iteration's peak (34e9 + micro-batch x 1e9) within 80e9
    assert memory.largest_micro_batch(per, 10**9, 1e9) == 46
    assert memory.largest_micro_batch({**per, "resume": 60.0}, 10**9, 1e9) == 0  # a step that cannot fit

    fit = _fit()
    models = {"BERT-Large": {"params": 336_232_258, "hidden": 1024, "layers": 24},
              "BERT-XL": {"params": 2_767_626_050, "hidden": 2560, "layers": 34}}
    page = memory.render({"slamb_v2": per}, models, fit, 64, {32: 5.57})
    assert "| slamb_v2 | 1.3 | 1.3 | 1.3 | 4.0 | 1.3 | 9.4 | 10.1 |" in page  # BERT-Large in GB
    assert "BERTs of 52M and 107M parameters" in page
    # BERT-Large: 128 x (24 x (100 x 1024 + 16) + 12 x 1024 + 366,000 + 49 x 1024) bytes per sequence
    per_seq = 128 * (24 * (100 * 1024 + 16) + 12 * 1024 + 366_000 + 49 * 1024)
    assert memory.activations(fit, 1024, 24, 1) == per_seq
    assert f"Activations: {per_seq / 1e9:.3f} GB per sequence" in page
    assert f"| 32 | 5.57 | {32 * per_seq / 1e9:.2f} |" in page
    assert "no (" in page.split("## BERT-XL")[1] and "yes (" in page.split("## BERT-XL")[0]


def test_activation_fit_predicts_a_size_it_was_not_made_from():
    """At small sizes (hidden 64 and 128, sequence 64, BERT's vocabulary, whose logits make the peak at the
    start of backward, as at full size): the fit of four sizes predicts a held-out fifth (hidden 192, three
    layers), measured the same way, to 0.1%. (The four sizes determine the fit's four terms: it goes through
    them by construction, so only a held-out size tests it.)"""
    fit = memory.activation_fit(sizes=((64, 1), (64, 2), (128, 1), (128, 2)), batches=(4, 8), seq=64)
    got = [memory.activation_bytes(memory._bert_config(192, 3), b, 64) for b in (4, 8)]
    per_token = (got[1]["peak"] - got[0]["peak"]) / (4 * 64)
    assert memory.per_token_bytes(fit, 192, 3, cuda_dropout=False) == pytest.approx(per_token, rel=1e-3)
    # a layer keeps tens of bytes per hidden unit and token (inputs of its matmuls, attention's q, k, v and out)
    assert 30 < fit["a"] < 60
    # CUDA's one-byte dropout masks: after the embeddings and twice per layer
    assert memory.per_token_bytes(fit, 192, 3) - memory.per_token_bytes(fit, 192, 3, cuda_dropout=False) == 7 * 192


def test_activations_are_linear_in_the_micro_batch():
    config = memory._bert_config(64, 1, vocab_size=512)
    got = [memory.activation_bytes(config, b, 32) for b in (2, 4, 6)]
    assert got[2]["peak"] - got[1]["peak"] == got[1]["peak"] - got[0]["peak"] > 0
    assert got[2]["saved"] - got[1]["saved"] == got[1]["saved"] - got[0]["saved"] > 0
    assert all(g["saved"] < g["peak"] for g in got)  # backward's gradients come on top of what forward kept


def test_live_bytes_follow_a_freed_temporary():
    with memory._Live() as live:
        x = torch.ones(1000)
        y = x * 2  # 4,000 bytes
        del y
        z = x + 1  # made after y went: the peak holds x and one of them
    assert live.peak == 8000 and live.total == 8000 and z.numel() == 1000


def _cut_worker(numel, queue):
    from slamb.optim.masks import CyclicMask

    res = memory.Resident()
    original = CyclicMask._recut
    with memory.HostCut(res) as cut:
        cut.start()
        res.reset()
        mask = CyclicMask(numel, seed=0, device=torch.device("cpu"))
        mask(0, 0.1)
        gc.collect()
        device = cut.device_peak() - res.now()
    queue.put((cut.host, device, CyclicMask._recut is original))


@pytest.mark.multiprocess  # measured in a process of its own, as the bench measures
def test_v1_cut_is_host_memory_apart_from_the_step():
    """The cyclic mask's randperm (8 bytes per coordinate, and its sorted copy) gets its own window: its
    bytes are host bytes, and the device peak is the step's without them. In a fresh process whose freed
    blocks go back to the OS, as the bench's: in pytest's own, freed pages still resident hide part of the cut."""
    from bench.optimizer_step import _spawn

    numel = 4 * 2**20
    host, device, restored = _spawn(_cut_worker, (numel,), {"MALLOC_MMAP_THRESHOLD_": str(1 << 20)})
    assert host >= 16 * numel  # the permutation and its sorted chunks, int64
    assert device < 2 * numel  # the step's own: the drawn positions (k N int64), not the cut
    assert restored  # the measuring patch is gone after the phase


def test_committed_page_beside_the_gpu_measurement():
    """The page's activations of BERT-Large against the H100's (results/gpu/nvidia-h100-80gb-hbm3.md)."""
    page = (memory.OUT).read_text()
    section = page.split("### Beside the GPU", 1)[1].split("##", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and "GB" not in line]
    ratios = {int(r[0]): float(r[3]) for r in rows}
    assert set(ratios) == set(memory.calibration_gb()) and all(0.95 < v < 1.05 for v in ratios.values())
    assert "| 64 | 11.12 |" in section


def test_rows_include_fused_slamb():
    assert set(memory.rows()) == {"lamb", "onebit_lamb", "slamb_v2", "slamb_v1", "slamb_v2_fused", "slamb_v1_fused"}


@pytest.mark.multiprocess  # 2 gloo processes
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
        # the evaluation's clone: each floating-point parameter once, fp32 (BERT's buffers are integer)
        assert row["clone"] == pytest.approx(4.0) and row["clone_fixed"] == pytest.approx(0.0, abs=1e-6)
        for n, measured in zip(row["numel"], row["measured"]):  # peaks above the resident memory, at each size
            assert min(measured[k] for k in ("first", "later", "resume", "rebuild", "eval")) >= 0
            assert measured["resume_host"] >= measured["state"]  # the loaded state, read to the CPU
