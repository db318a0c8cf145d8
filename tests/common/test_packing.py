"""Boundary-aware packing (stages/text/packing.py, tokenize.packing): rows packed into one sequence train as
they would alone. On a tiny random llama in fp32: each row's summed loss packed equals its loss unpacked (one
packed sequence, and micro-batches of two right-padded ones), the gradients too, a packed micro-batch x
accumulation equals the other split, and changing one row's tokens never moves another row's logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stages.methods.sft import SFT
from stages.text.packing import best_fit_decreasing, keeps_rows_apart, pack_rows
from stages.text.tokens import IGNORE_INDEX
from stages.training.batching import Rows

TASK = SFT()


def collate(rows, pad, method):
    return method.collate(rows, pad)


def summed_loss(model, b):
    return TASK.step(model, b).loss_sum
PAD = 0
LENGTHS = [9, 3, 14, 5, 7, 11, 4, 6, 2, 8]  # rows of different lengths, packed into sequences of 16


def tiny_llama(attn: str = "sdpa") -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=97, max_position_embeddings=64, attn_implementation=attn)
    return LlamaForCausalLM(cfg).float()


def rows_of(lengths: list[int], seed: int = 1) -> list[dict]:
    """Rows with a prompt (no labels) then an answer (labels), as the tokenize stage writes them."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, 97, (n,), generator=g).tolist()
        prompt = n // 3
        out.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return out


def packed_rows(rows: list[dict], max_length: int = 16) -> tuple[list[dict], list[list[int]]]:
    p = pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], max_length)
    seqs = [{"input_ids": i, "labels": y, "position_ids": q}
            for i, y, q in zip(p.input_ids, p.labels, p.position_ids, strict=True)]
    return seqs, p.rows


def per_row_loss(model: torch.nn.Module, seqs: list[dict], members: list[list[int]], n_rows: int) -> torch.Tensor:
    """Each unpacked row's summed loss, read off one packed micro-batch of `seqs` (the train step's collate and
    forward; a row's token losses end where the next row's position ids restart at 0)."""
    b = collate(seqs, PAD, TASK)
    logits = model(input_ids=b["input_ids"], position_ids=b.get("position_ids"), use_cache=False).logits[:, :-1]
    tok = F.cross_entropy(logits.float().transpose(1, 2), b["labels"][:, 1:], ignore_index=IGNORE_INDEX,
                          reduction="none")
    out = torch.zeros(n_rows)
    for s, rows in enumerate(members):
        pos = seqs[s]["position_ids"]
        starts = [k for k, q in enumerate(pos) if q == 0] + [len(pos)]
        assert len(starts) == len(rows) + 1
        for r, a, z in zip(rows, starts, starts[1:], strict=False):
            out[r] = tok[s, a:z - 1].sum()  # the token at t predicts t+1: a row's last token predicts nothing
    return out


def alone(model: torch.nn.Module, rows: list[dict]) -> torch.Tensor:
    return torch.stack([summed_loss(model, collate([r], PAD, TASK)) for r in rows])


def test_best_fit_decreasing_fills_the_tightest_gap_deterministically():
    bins = best_fit_decreasing([9, 3, 14, 5, 7, 11, 4, 6, 2, 8], 16)
    assert sorted(i for b in bins for i in b) == list(range(10))
    assert all(sum(LENGTHS[i] for i in b) <= 16 for b in bins)
    # longest first: 14 opens a bin, 11 a second, 9 a third; 8 fits no open gap (2, 5, 7) -> a fourth; 7 fills the
    # 9's gap exactly; 6 -> the 8's bin (gap 8, the only one that holds it); 5 -> the 11's (exactly 5 left)
    assert bins == [[2, 8], [5, 3], [0, 4], [9, 7], [6, 1]]
    assert best_fit_decreasing([9, 3, 14, 5, 7, 11, 4, 6, 2, 8], 16) == bins
    with pytest.raises(ValueError, match="row 0 has 17 tokens"):
        best_fit_decreasing([17], 16)


def test_packed_labels_mask_each_rows_first_token_and_positions_restart():
    rows = rows_of([3, 4])
    p = pack_rows([r["input_ids"] for r in rows], [r["labels"] for r in rows], 16)
    assert p.rows == [[1, 0]] and p.position_ids == [[0, 1, 2, 3, 0, 1, 2]]
    assert p.input_ids == [rows[1]["input_ids"] + rows[0]["input_ids"]]
    assert p.labels == [[IGNORE_INDEX, *rows[1]["labels"][1:], IGNORE_INDEX, *rows[0]["labels"][1:]]]
    assert p.stats(16) == {"strategy": "best-fit decreasing", "rows": 2, "sequences": 1, "tokens": 7,
                           "fill": round(7 / 16, 4)}


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_each_rows_loss_packed_equals_its_loss_unpacked(attn):
    model = tiny_llama(attn)
    rows = rows_of(LENGTHS)
    seqs, members = packed_rows(rows)
    assert max(len(m) for m in members) >= 2  # sequences that hold several rows
    want = alone(model, rows)
    with torch.no_grad():
        for s in range(len(seqs)):  # one packed sequence at a time
            got = per_row_loss(model, [seqs[s]], [members[s]], len(rows))
            for r in members[s]:
                assert abs(float(got[r] - want[r])) < 1e-5, (s, r)
        # micro-batches of two packed sequences: the last (7 tokens, two rows) right-padded to the other's length
        last = len(seqs) - 1
        for s in range(last):
            pair = [seqs[s], seqs[last]]
            got = per_row_loss(model, pair, [members[s], members[last]], len(rows))
            rs = members[s] + members[last]
            assert torch.allclose(got[rs], want[rs], atol=1e-5, rtol=0)
            # the task's summed loss of the padded micro-batch (what the train step backpropagates) and its units
            b = collate(pair, PAD, TASK)
            assert b.padded_tokens > b.real_tokens
            assert abs(float(summed_loss(model, b)) - float(want[rs].sum())) < 1e-5
            assert b.units == sum(collate([rows[r]], PAD, TASK).units for r in rs)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_gradients_packed_equal_unpacked():
    model = tiny_llama()
    rows = rows_of(LENGTHS)
    seqs, _ = packed_rows(rows)
    units = sum(collate([r], PAD, TASK).units for r in rows)
    for r in rows:  # unpacked: one row per micro-batch
        (summed_loss(model, collate([r], PAD, TASK)) / units).backward()
    want = grads(model)
    for i in range(0, len(seqs), 2):  # packed: two right-padded sequences per micro-batch
        (summed_loss(model, collate(seqs[i:i + 2], PAD, TASK)) / units).backward()
    got = grads(model)
    assert want.keys() == got.keys() and len(got) > 10
    diff = max(float((got[k] - want[k]).abs().max()) for k in want)
    scale = max(float(want[k].abs().max()) for k in want)
    assert diff < 1e-6 * max(scale, 1.0), diff


def test_a_packed_micro_batch_times_accumulation_equals_the_other_split():
    """The train step's window (stages/train.py) over packed rows: micro-batch 4 x accumulation 1 and
    micro-batch 1 x accumulation 4 (and 2 x 2) give the same gradients: the loss is summed and divided by the
    label count of the whole window."""
    model = tiny_llama()
    seqs, _ = packed_rows(rows_of(LENGTHS + [12, 3, 10, 1]))
    data = Rows(seqs)
    assert data.packed
    idx = list(range(4))

    def window(micro: int) -> dict[str, torch.Tensor]:
        batches = data.batches(idx, micro, PAD, TASK)
        assert all(b.get("position_ids") is not None for b in batches)
        units = sum(b.units for b in batches)
        for b in batches:
            (summed_loss(model, b) / units).backward()
        return grads(model)

    one = window(4)
    for micro in (1, 2):
        other = window(micro)
        assert max(float((one[k] - other[k]).abs().max()) for k in one) < 1e-6


def test_attention_cannot_cross_rows_in_a_packed_sequence():
    model = tiny_llama()
    rows = rows_of([6, 5])
    seqs, members = packed_rows(rows)
    assert members == [[0, 1]]
    changed = [dict(s) for s in seqs]
    changed[0]["input_ids"] = [(t + 7) % 96 + 1 for t in seqs[0]["input_ids"][:6]] + seqs[0]["input_ids"][6:]

    def logits(batch: list[dict]) -> torch.Tensor:
        b = collate(batch, PAD, TASK)
        with torch.no_grad():
            return model(input_ids=b["input_ids"], position_ids=b.get("position_ids"), use_cache=False).logits[0]

    before, after = logits(seqs), logits(changed)
    assert not torch.allclose(before[:6], after[:6])  # row 1 changed
    assert torch.equal(before[6:], after[6:]) or torch.allclose(before[6:], after[6:], atol=1e-6, rtol=0)
    # and the second row's logits are its logits alone
    with torch.no_grad():
        solo = model(input_ids=torch.tensor([rows[1]["input_ids"]]), use_cache=False).logits[0]
    assert torch.allclose(before[6:], solo, atol=1e-5, rtol=0)


def test_the_packing_probe_accepts_llama_and_its_peft_wrapper_and_refuses_a_model_that_leaks(tmp_path):
    import peft

    model = tiny_llama()
    assert keeps_rows_apart(model, "cpu")
    wrapped = peft.get_peft_model(tiny_llama(), peft.LoraConfig(task_type="CAUSAL_LM", r=4,
                                                                target_modules=["q_proj", "v_proj"]))
    assert keeps_rows_apart(wrapped, "cpu") and wrapped.training

    class Leaky(torch.nn.Module):  # a model that builds its own full causal mask (ignores the position ids)
        def __init__(self, inner: torch.nn.Module):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, position_ids=None, **kw):
            return self.inner(input_ids=input_ids, **kw)

    assert not keeps_rows_apart(Leaky(model), "cpu")
    # the train stage refuses such a model before its first step
    import logging

    from stages.engine.errors import ConfigError
    from stages.pipeline.schema import TrainConfig
    from stages.train import train_model

    seqs, _ = packed_rows(rows_of([6, 5, 4]))
    with pytest.raises(ConfigError, match=r"^tokenize.packing: this model \(Leaky\) lets packed rows attend to "
                       r"each other .*; set tokenize.packing: false$"):
        train_model(Leaky(model), seqs, None, TrainConfig(max_steps=1), "causal_lm", PAD, tmp_path / "out",
                    tmp_path / "work", logging.getLogger("test.packing"))
    assert not (tmp_path / "work" / "checkpoints").exists()


def test_with_the_configs_cache_on_transformers_sees_no_packing():
    """Why the loss passes use_cache=False: a llama's config has use_cache true, the forward then builds a cache,
    and transformers looks for packed rows only without one (masking_utils._preprocess_mask_arguments)."""
    model = tiny_llama().eval()
    rows = rows_of([6, 5])
    seqs, _ = packed_rows(rows)
    b = collate(seqs, PAD, TASK)
    with torch.no_grad():
        solo = model(input_ids=torch.tensor([rows[1]["input_ids"]])).logits[0]
        cached = model(input_ids=b["input_ids"], position_ids=b.get("position_ids")).logits[0, 6:]
        uncached = model(input_ids=b["input_ids"], position_ids=b.get("position_ids"), use_cache=False).logits[0, 6:]
    assert model.config.use_cache
    assert not torch.allclose(cached, solo, atol=1e-3)
    assert torch.allclose(uncached, solo, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- the train loop on packed rows

SEQS = packed_rows(rows_of([9, 3, 14, 5, 7, 11, 4, 6, 2, 8, 12, 3, 10, 13, 6, 5, 9, 2, 15, 4, 7, 8], seed=3))[0]
SETTINGS = {"lr": 1e-2, "seed": 7, "optimizer": "adamw_torch", "lr_scheduler": "constant", "micro_batch_size": 1,
            "gradient_accumulation_steps": 2, "log_every": 100, "max_grad_norm": 1.0}


def train_packed(args: dict) -> dict:
    """The train stage's core on the packed sequences (in this process, or in each launched process);
    `weights`: where rank 0 saves the trained weights."""
    import logging
    import os
    from pathlib import Path

    from safetensors.torch import save_file

    from stages.pipeline.schema import TrainConfig
    from stages.train import train_model

    torch.set_num_threads(1)
    model = tiny_llama()
    m = train_model(model, SEQS, None, TrainConfig(**{**SETTINGS, **args["settings"]}), "causal_lm", PAD,
                    Path(args["out"]), Path(args["work"]), logging.getLogger("test.packing"))
    if int(os.environ.get("RANK", 0)) == 0:
        save_file({n: p.detach().clone().contiguous() for n, p in model.named_parameters()}, args["weights"])
    return m


def trained(tmp_path, name: str, work: str | None = None, **settings) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    d = tmp_path / name
    m = train_packed({"out": str(d / "out"), "work": str(tmp_path / (work or name) / "work"),
                      "weights": str(d / "w.st"), "settings": settings})
    return m, load_file(str(d / "w.st"))


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_packed_training_resumes_where_it_stopped(tmp_path):
    """Resume counts effective batches of packed sequences: 3 steps, then a rerun to 8 from that checkpoint,
    gives the weights of 8 steps straight (across an epoch boundary: 11 sequences, 6 steps an epoch, the last
    one short)."""
    assert len(SEQS) == 11
    ref, ref_w = trained(tmp_path, "straight", max_steps=8)
    first, _ = trained(tmp_path, "first", max_steps=3)
    again, again_w = trained(tmp_path, "again", work="first", max_steps=8)
    assert first["steps"] == 3 and again["resumed_from_step"] == 3 and again["steps"] == ref["steps"] == 8
    assert ref["examples"] == 11 and ref["real_tokens"] == again["real_tokens"]
    assert ref["final_loss"] < ref["first_loss"]
    assert max_diff(ref_w, again_w) < 1e-6


@pytest.mark.slow
def test_packed_rows_on_two_processes_match_one_process(tmp_path):
    """2 gloo processes x micro-batch 1 x accumulation 1 = 1 process x 1 x 2 on the packed sequences (the
    short last batch of each epoch leaves one process none: its zero-weight pass is a packed sequence too)."""
    import logging
    from pathlib import Path

    from safetensors.torch import load_file

    from stages.training.distributed import launch

    ref, ref_w = trained(tmp_path, "one", max_steps=8)
    here = Path(__file__).resolve().parent
    m = launch("test_packing:train_packed", {"out": str(tmp_path / "two" / "out"), "work": str(tmp_path / "two" / "w"),
                                             "weights": str(tmp_path / "two.st"),
                                             "settings": {"max_steps": 8, "gradient_accumulation_steps": 1}},
               2, tmp_path / "launch", logging.getLogger("test.packing"), pythonpath=[str(here), str(here.parent)])
    assert m["num_processes"] == 2 and m["effective_batch"] == ref["effective_batch"] == 2
    assert m["real_tokens"] == ref["real_tokens"]
    assert m["final_loss"] == pytest.approx(ref["final_loss"], abs=1e-5)
    assert max_diff(ref_w, load_file(str(tmp_path / "two.st"))) < 1e-5
