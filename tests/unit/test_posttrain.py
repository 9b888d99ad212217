"""megarl sft / rm without processes: data rows and their errors, tokenisation, the built-in sets,
the split and the epochs, the losses' values against hand computations, the reward spec and the
reward-model normalisations, the seq-cls export config, the CLI's data errors."""
import json
import math

import pytest
import torch
from helpers import smollm2_tokenizer, write_jsonl

from megarl.posttrain import data as D
from megarl.algorithms.posttrain import bt_loss, eval_sums, make_loss_fn, pair_metrics, sft_loss, summarize


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def load(path, kind, tok, **kw):
    return D.load_examples(path, kind, tok, use_chat_template=kw.pop("chat", True),
                           max_seq_tokens=kw.pop("max_seq_tokens", 512), **kw)


# ----------------------------------------------------------------------------- data
def test_sft_rows_both_forms_tokenise_alike_and_end_at_eos(tmp_path, tok):
    path = write_jsonl(tmp_path / "a.jsonl", [
        {"prompt": "What is 2 + 3?", "response": "2 + 3 = 5.\n#### 5"},
        {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                      {"role": "assistant", "content": "2 + 3 = 5.\n#### 5"}]}])
    ex = load(path, "sft", tok)
    assert ex.prompt_ids[0] == ex.prompt_ids[1] and ex.response_ids[0] == ex.response_ids[1]
    assert ex.response_ids[0][-1] == tok.eos_token_id            # no newline after the end of turn
    assert tok.decode(ex.response_ids[0]) == "2 + 3 = 5.\n#### 5<|im_end|>"
    full = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"},
                                    {"role": "assistant", "content": "2 + 3 = 5.\n#### 5"}], tokenize=True)
    full = list(full["input_ids"] if hasattr(full, "keys") else full)
    assert full[:len(ex.prompt_ids[0]) + len(ex.response_ids[0])] == ex.prompt_ids[0] + ex.response_ids[0]
    assert ex.where == [f"{path}: line 1", f"{path}: line 2"]


def test_without_chat_template_the_response_gets_eos(tmp_path, tok):
    ex = load(write_jsonl(tmp_path / "a.jsonl", [{"prompt": "Q", "response": "A"}]), "sft", tok, chat=False)
    assert ex.response_ids[0][-1] == tok.eos_token_id and ex.prompt_ids[0] == tok("Q").input_ids


@pytest.mark.parametrize("row, field, what", [
    ({"prompt": "Q"}, "response", "missing field 'response'"),
    ({"prompt": "Q", "response": "  "}, "response", "empty response"),
    ({"prompt": "Q", "response": 3}, "response", "expected a string"),
    ({"response": "A"}, None, "missing field 'messages' or 'prompt'"),
    ({"messages": [{"role": "user", "content": "Q"}]}, "messages", "the last message must be the assistant's"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": ""}]}, "messages",
     "empty response"),
])
def test_bad_sft_rows_name_file_line_and_field(tmp_path, tok, row, field, what):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "response": "fine"}, "", row])
    with pytest.raises(D.DataError) as err:
        load(path, "sft", tok)
    assert f"{path}: line 3" in str(err.value) and what in str(err.value)
    if field:
        assert f"field {field!r}" in str(err.value)


@pytest.mark.parametrize("row, what", [
    ({"prompt": "Q", "chosen": "same", "rejected": " same "}, "field 'rejected': identical to 'chosen'"),
    ({"prompt": "Q", "chosen": "a"}, "missing field 'rejected'"),
    ({"prompt": "Q", "chosen": "a", "rejected": "b", "margin": "big"}, "field 'margin': expected a finite number"),
    ({"chosen": "a", "rejected": "b"}, "missing field 'prompt'"),
])
def test_bad_pairs_are_named(tmp_path, tok, row, what):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(D.DataError, match=f"line 1.*{what}"):
        load(path, "pairs", tok)


def test_over_the_token_budget_and_skip_mode(tmp_path, tok):
    rows = [{"prompt": "Q", "response": "word " * 200}, {"prompt": "Q", "response": "short"},
            {"prompt": "Q", "response": ""}]
    path = write_jsonl(tmp_path / "a.jsonl", rows)
    with pytest.raises(D.DataError, match=r"line 1, field 'response': prompt \+ response is \d+ tokens > "
                                          r"posttrain.max_seq_tokens=100"):
        load(path, "sft", tok, max_seq_tokens=100)
    ex = load(path, "sft", tok, max_seq_tokens=100, on_bad_row="skip")
    assert len(ex) == 1 and sum(ex.skipped.values()) == 2 and len(ex.skipped) == 2
    with pytest.raises(D.DataError, match="no usable row"):
        load(write_jsonl(tmp_path / "b.jsonl", rows[:1]), "sft", tok, max_seq_tokens=100, on_bad_row="skip")


def test_parquet_rows_are_named_by_row(tmp_path, tok):
    rows = [("x", {"prompt": "Q", "chosen": "a", "rejected": "b", "margin": 0.5}),
            ("y", {"prompt": "Q", "chosen": "a", "rejected": "a"})]
    path = str(tmp_path / "p.parquet")
    D.write_rows(rows, path)
    with pytest.raises(D.DataError, match=r"p.parquet: row 1, field 'rejected'"):
        load(path, "pairs", tok)
    assert load(path, "pairs", tok, on_bad_row="skip").margins == [0.5]


def test_pairs_sequences_are_adjacent(tmp_path, tok):
    ex = load(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "Q", "chosen": "yes", "rejected": "no"}]), "pairs", tok)
    seqs, prompts = ex.sequences([0])
    assert seqs == [ex.prompt_ids[0] + ex.response_ids[0], ex.prompt_ids[0] + ex.rejected_ids[0]]
    assert prompts == [len(ex.prompt_ids[0])] * 2 and ex.length(0) == len(seqs[0]) + len(seqs[1])


def test_a_pair_is_planned_at_the_packed_size_of_its_two_sequences():
    from megarl.data.batching import packed_tokens

    ex = D.Examples("pairs", [[1] * 5], [[2] * 8], [[3] * 4], [0.0])   # sequences of 13 and 9 tokens
    for tp, cp in ((1, 1), (2, 1), (2, 2), (1, 4)):
        both = packed_tokens(13, tp, cp) + packed_tokens(9, tp, cp)
        assert packed_tokens(ex.length(0, tp, cp), tp, cp) == both, (tp, cp)
    assert ex.length(0) == 22 and packed_tokens(22, 2, 2) < packed_tokens(13, 2, 2) + packed_tokens(9, 2, 2)


def test_builtin_sets_are_deterministic_correct_and_disjoint_from_rl_prompts():
    from megarl.rewards.math import gsm8k_reward
    from megarl.tasks.arithmetic import generate_arithmetic

    sft = D.builtin_rows("builtin:arithmetic_sft", 300, 2, 0)
    assert sft == D.builtin_rows("builtin:arithmetic_sft", 300, 2, 0) and len(sft) == 300
    quickstart = {r.prompt for r in generate_arithmetic(3000, level=1, seed=0)}
    assert len(quickstart) == 100 and not quickstart & {row["prompt"] for _, row in sft}
    with pytest.raises(D.DataError, match="level 1 has only 100 problems"):
        D.builtin_rows("builtin:arithmetic_sft", 10, 1, 0)
    sft = D.builtin_rows("builtin:arithmetic_sft", 200, 3, 0)
    for _, row in sft:   # every worked answer is right by the RL reward's own checker
        expr = row["prompt"].split("What is ")[1].split("?")[0]
        assert gsm8k_reward(row["response"], str(eval(expr))) == 1.0
    prefs = D.builtin_rows("builtin:arithmetic_prefs", 200, 3, 0)
    wrong = sum(gsm8k_reward(row["rejected"], str(eval(row["prompt"].split("What is ")[1].split("?")[0]))) == 0.0
                for _, row in prefs)
    assert wrong == 200 and all(row["chosen"] != row["rejected"] for _, row in prefs)
    assert 40 < sum("####" not in row["rejected"] for _, row in prefs) < 160   # both kinds of rejection


def test_worked_answer_precedence():
    assert D.worked_answer("3 + 4 * 5 - 2") == ("4 * 5 = 20.\n3 + 20 = 23.\n23 - 2 = 21.\n#### 21", 21)
    assert D.worked_answer("7") == ("The value is 7.\n#### 7", 7)


def test_split_and_epochs():
    ex = D.Examples("sft", [[1]] * 40, [[2]] * 40, where=[str(i) for i in range(40)])
    train, held = D.split_eval(ex, 0.1, seed=0)
    assert len(train) == 36 and len(held) == 4 and not set(train.where) & set(held.where)
    with pytest.raises(D.DataError, match="eval_fraction"):
        D.split_eval(D.Examples("sft", [[1]], [[2]]), 0.5, 0)
    assert D.steps_per_epoch(36, 8) == 4
    seen = [D.step_indices(36, 8, s, seed=1) for s in range(1, 9)]
    assert [e for e, _ in seen] == [0] * 4 + [1] * 4
    first = [i for _, idx in seen[:4] for i in idx]
    assert len(set(first)) == 32 and all(len(idx) == 8 for _, idx in seen)
    assert [i for _, idx in seen[4:] for i in idx] != first          # reshuffled per epoch
    assert D.step_indices(36, 8, 3, seed=1) == seen[2]                # a function of (seed, step): resume


# ----------------------------------------------------------------------------- losses
class B:   # the part of a SequenceBatch the losses read
    def __init__(self, lengths, extras=None, gtokens=None, gseqs=None):
        self.cu_seqlens_N1 = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
        self.extras = extras or {}
        self.num_global_tokens, self.num_global_sequences = gtokens, gseqs
        self.input_ids = [None] * len(lengths)


def test_sft_loss_token_mean_and_sequence_sum():
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0, -5.0])
    loss, m = sft_loss(lp, B([2, 3], gtokens=10, gseqs=4), "token-mean")
    assert loss.item() == pytest.approx(15 / 10) and m["nll_sum"].item() == 15 and m["tokens"].item() == 5
    loss, _ = sft_loss(lp, B([2, 3], gtokens=10, gseqs=4), "seq-mean-token-sum")
    assert loss.item() == pytest.approx((3 + 12) / 4)
    mask = torch.tensor([True, False, True, True, False])
    loss, m = sft_loss(lp, B([2, 3], {"mask_T": mask}, gtokens=3, gseqs=2), "token-mean")
    assert loss.item() == pytest.approx(8 / 3) and m["tokens"].item() == 3


def test_bradley_terry_loss_and_metrics():
    scores = torch.tensor([2.0, 0.5, -1.0, 0.0])   # pairs (2.0 vs 0.5), (-1.0 vs 0.0)
    loss, m = bt_loss(scores, B([1, 1, 1, 1], gseqs=8))
    expect = (-math.log(1 / (1 + math.exp(-1.5))) - math.log(1 / (1 + math.exp(1.0)))) / 4
    assert loss.item() == pytest.approx(expect, rel=1e-6)
    assert m["correct_sum"].item() == 1 and m["margin_sum"].item() == pytest.approx(0.5) and m["pairs"].item() == 2
    margin = {"margin_P": torch.tensor([1.0, 0.0])}
    loss_m, _ = bt_loss(scores, B([1] * 4, margin, gseqs=4), use_margin=True)
    assert loss_m.item() == pytest.approx((-math.log(1 / (1 + math.exp(-0.5))) - math.log(1 / (1 + math.exp(1.0)))) / 2,
                                          rel=1e-6)
    with pytest.raises(ValueError, match="expected pairs"):
        bt_loss(torch.zeros(3), B([1, 1, 1]))
    s = summarize("rm", {k: float(v) for k, v in pair_metrics(scores[0::2], scores[1::2]).items()}, "eval")
    assert s["eval/accuracy"] == 0.5 and s["eval/score_mean"] == pytest.approx(0.375)
    assert s["eval/score_std"] == pytest.approx(float(scores.std(unbiased=False)), rel=1e-6)
    with pytest.raises(ValueError, match="unknown post-training stage"):
        make_loss_fn("kto")


def test_dpo_ipo_and_cdpo_losses_by_hand():
    # 2 pairs; response lengths chosen 2, rejected 1 | chosen 1, rejected 3
    lp = torch.tensor([-1.0, -2.0, -4.0, -0.5, -1.0, -1.0, -1.0])
    ref = torch.tensor([-1.5, -2.0, -3.0, -1.0, -0.5, -1.0, -1.0])
    batch = B([2, 1, 1, 3], {"ref_logprobs_R": ref}, gseqs=8)   # 4 pairs over the step: / 4
    ratios = [(-3.0 - -3.5, -4.0 - -3.0), (-0.5 - -1.0, -3.0 - -2.5)]   # (chosen, rejected) log pi - log ref
    beta = 0.5
    loss, m = make_loss_fn("dpo", beta=beta)(lp, batch)
    sig = lambda x: 1 / (1 + math.exp(-x))   # noqa: E731
    per_pair = [-math.log(sig(beta * (c - r))) for c, r in ratios]
    assert loss.item() == pytest.approx(sum(per_pair) / 4, rel=1e-6)
    s = summarize("dpo", {k: float(v) for k, v in m.items()}, "train")
    assert s["train/rewards/chosen"] == pytest.approx(beta * (0.5 + 0.5) / 2)
    assert s["train/rewards/rejected"] == pytest.approx(beta * (-1.0 - 0.5) / 2)
    assert s["train/rewards/margins"] == pytest.approx(beta * (1.5 + 1.0) / 2)
    assert s["train/rewards/accuracies"] == 1.0
    assert s["train/logps/chosen"] == pytest.approx((-3.0 - 0.5) / 2) and s["train/logps/rejected"] == -3.5
    eps = 0.1   # cDPO
    loss, _ = make_loss_fn("dpo", beta=beta, label_smoothing=eps)(lp, batch)
    assert loss.item() == pytest.approx(sum(-(1 - eps) * math.log(sig(beta * (c - r))) - eps * math.log(
        sig(-beta * (c - r))) for c, r in ratios) / 4, rel=1e-6)
    loss, _ = make_loss_fn("dpo", beta=beta, loss="ipo")(lp, batch)   # log-ratios per response token
    per_token = [(0.5 / 2, -1.0 / 1), (0.5 / 1, -0.5 / 3)]
    assert loss.item() == pytest.approx(sum((c - r - 1 / (2 * beta)) ** 2 for c, r in per_token) / 4, rel=1e-6)
    loss, _ = make_loss_fn("dpo", beta=beta, sft_weight=0.2)(lp, batch)   # + chosen mean token NLL
    assert loss.item() == pytest.approx((sum(per_pair) + 0.2 * (3.0 / 2 + 0.5 / 1)) / 4, rel=1e-6)
    # precomputed: each sequence's reference sum instead of its per-token log-probs, same loss and metrics
    sums = torch.tensor([-3.5, -3.0, -1.0, -2.5], dtype=torch.float64)
    for options in ({"beta": beta}, {"beta": beta, "loss": "ipo"}):
        per_token = make_loss_fn("dpo", **options)(lp, batch)
        summed = make_loss_fn("dpo", **options)(lp, B([2, 1, 1, 3], {"ref_logps_N": sums}, gseqs=8))
        assert summed[0].item() == per_token[0].item() and summed[1].keys() == per_token[1].keys()
        assert all(summed[1][k].item() == per_token[1][k].item() for k in summed[1])


def test_dpo_options_are_checked():
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="posttrain.dpo.label_smoothing"):
        load_config(None, ["posttrain.dpo.label_smoothing=0.5"])
    with pytest.raises(ConfigError, match="posttrain.dpo.label_smoothing"):
        load_config(None, ["posttrain.dpo.label_smoothing=0.1", "posttrain.dpo.loss=ipo"])
    with pytest.raises(ConfigError, match="posttrain.dpo.beta"):
        load_config(None, ["posttrain.dpo.beta=0"])
    assert load_config(None, ["posttrain.dpo.loss=ipo"]).posttrain.dpo.loss == "ipo"
    with pytest.raises(ConfigError, match="posttrain.dpo.reference"):
        load_config(None, ["posttrain.dpo.reference=once"])


def test_eval_sums_of_a_fake_engine():
    class Out:
        def __init__(self, lp):
            self.logprobs_R = lp

    class Engine:
        def forward_logprobs(self, mbs):
            return [Out(torch.tensor([-1.0, -2.0, -3.0]))]

        def forward_scores(self, mbs):
            return [torch.tensor([1.0, 0.0])]

    mb = B([1, 2])
    sums = eval_sums("sft", Engine(), [mb], loss_agg="seq-mean-token-sum")
    assert sums["loss_sum"] == 6 and sums["count"] == 2 and sums["tokens"] == 3
    mb.extras["margin_P"] = torch.tensor([0.0])
    sums = eval_sums("rm", Engine(), [mb])
    assert sums["loss_sum"] == pytest.approx(-math.log(1 / (1 + math.exp(-1.0)))) and sums["correct_sum"] == 1


# ----------------------------------------------------------------------------- reward spec and model term
def test_reward_spec():
    from megarl.rewards.spec import is_plain, model_term, parse_reward

    assert is_plain(parse_reward("gsm8k"))
    terms = parse_reward("1.0*model:runs/rm/hf + 0*gsm8k_lenient")
    assert [(t.weight, t.name, t.is_model, t.label) for t in terms] == [
        (1.0, "model:runs/rm/hf", True, "model"), (0.0, "gsm8k_lenient", False, "gsm8k_lenient")]
    assert model_term(terms).path == "runs/rm/hf" and not is_plain(terms)
    assert parse_reward("pkg.mod:fn")[0].label == "fn"
    for bad, what in (("x*gsm8k", "not a number"), ("gsm8k + ", "empty term"), ("model:", "model:PATH"),
                      ("model:a + model:b", "one is supported")):
        with pytest.raises(ValueError, match=what):
            parse_reward(bad)


def test_config_checks_of_the_reward(tmp_path):
    from megarl.config import load_config
    from megarl.config.errors import ConfigError

    with pytest.raises(ConfigError, match="data.reward"):
        load_config(None, ["data.reward=2x*gsm8k"], check_model=False)
    with pytest.raises(ConfigError, match="algorithm.dynamic_sampling"):
        load_config(None, ["data.reward=model:/x", "algorithm.name=dapo"])
    with pytest.raises(ConfigError, match="posttrain.train_file"):
        load_config(None, ["posttrain.train_file=data.csv"], check_model=False)


def test_reward_model_normalisations(tmp_path):
    from types import SimpleNamespace

    from megarl.rewards.model import RewardModelTerm

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    cfg = lambda norm: SimpleNamespace(data=SimpleNamespace(reward=f"model:{tmp_path}", reward_norm=norm))  # noqa
    term = RewardModelTerm(cfg("none"))
    assert term.pad_id == 2 and term.normalize([1.0, 3.0], [0, 0]) == [1.0, 3.0]
    g = RewardModelTerm(cfg("group")).normalize([1.0, 3.0, 5.0, 5.0], [0, 0, 1, 1])
    assert g == pytest.approx([-1.0, 1.0, 0.0, 0.0], abs=1e-5)
    w = RewardModelTerm(cfg("whiten"))
    a, b = [1.0, 2.0, 3.0], [10.0, 20.0]
    w.normalize(a, [0] * 3)
    out = w.normalize(b, [0] * 2)
    allx = torch.tensor(a + b, dtype=torch.float64)
    assert w.count == 5 and w.mean == pytest.approx(float(allx.mean()))
    assert out == pytest.approx(((torch.tensor(b) - allx.mean()) / allx.std(unbiased=False)).tolist(), rel=1e-5)
    resumed = RewardModelTerm(cfg("whiten"), w.state())
    assert (resumed.count, resumed.mean, resumed.m2) == (w.count, w.mean, w.m2)


def test_trim_pads_keeps_one_response_token():
    from megarl.data.packing import trim_pads

    assert trim_pads([5, 6, 7, 2, 2], 2, pad_id=2) == [5, 6, 7]
    assert trim_pads([5, 6, 2], 2, pad_id=2) == [5, 6, 2]
    assert trim_pads([5, 6, 2], 2, pad_id=None) == [5, 6, 2]


def test_reward_model_config(tmp_path):
    from megarl.models.seqcls import is_reward_model, reward_model_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen2ForCausalLM"], "eos_token_id": [7, 8],
                                                      "vocab_size": 10}))
    cfg = json.loads(reward_model_config(str(tmp_path)))
    assert cfg["architectures"] == ["Qwen2ForSequenceClassification"] and cfg["num_labels"] == 1
    assert cfg["pad_token_id"] == 7 and cfg["id2label"] == {"0": "LABEL_0"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert is_reward_model(str(tmp_path)) and not is_reward_model(str(tmp_path / "nothing"))


def test_cli_data_error_before_any_process(tmp_path, capsys):
    from megarl.cli import main

    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "Q", "response": "A"}, {"prompt": "Q"}])
    rc = main(["sft", f"posttrain.train_file={bad}", "model.path=fixture:tiny-llama", "data.difficulty=2",
               f"trainer.run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert rc == 2 and f"{bad}: line 2: missing field 'response'" in err
    assert not (tmp_path / "run" / "logs").exists()            # stopped before the run started
    out = tmp_path / "prefs.jsonl"
    assert main(["data", "arithmetic_prefs", str(out), "--num-examples", "5"]) == 0
    assert len(out.read_text().splitlines()) == 5


def test_stage_data_steps_and_options_from_the_config(tmp_path, tok):
    from megarl.config import load_config
    from megarl.posttrain.run import load_stage_data, stage_options, stage_steps

    train = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"Q{i}", "chosen": "good", "rejected": "bad"}
                                               for i in range(20)] + [{"prompt": "Q", "chosen": "x", "rejected": "x"}])
    held = write_jsonl(tmp_path / "h.jsonl", [{"prompt": "E", "chosen": "good", "rejected": "bad", "margin": 2}])
    base = [f"posttrain.train_file={train}", "posttrain.batch_size=4", "model.path=fixture:tiny-llama"]
    with pytest.raises(D.DataError, match="line 21, field 'rejected': identical"):
        load_stage_data(load_config(None, base, check_model=False), "rm", tok)
    cfg = load_config(None, base + ["data.on_bad_row=skip", "posttrain.eval_fraction=0.25", "posttrain.epochs=3",
                                    "posttrain.margin=true"], check_model=False)
    tr, he = load_stage_data(cfg, "rm", tok)
    assert (len(tr), len(he)) == (15, 5) and tr.skipped and stage_steps(cfg, len(tr)) == 9
    assert stage_options(cfg, "rm") == {"use_margin": True}
    cfg = load_config(None, base + ["data.on_bad_row=skip", f"posttrain.eval_file={held}", "posttrain.max_steps=2",
                                    "posttrain.loss_agg=seq-mean-token-sum"], check_model=False)
    tr, he = load_stage_data(cfg, "rm", tok)
    assert (len(tr), len(he), he.margins) == (20, 1, [2.0]) and stage_steps(cfg, len(tr)) == 2
    assert stage_options(cfg, "sft") == {"loss_agg": "seq-mean-token-sum"}
    with pytest.raises(D.DataError, match="megarl sft reads SFT rows; the built-in set is builtin:arithmetic_sft"):
        load_stage_data(load_config(None, ["posttrain.train_file=builtin:arithmetic_prefs", "data.difficulty=2"],
                                    check_model=False), "sft", tok)
    cfg = load_config(None, ["data.reward=model:/x", "data.reward_norm=group"], check_model=False)
    assert cfg.data.reward_norm == "group"


def test_every_worker_method_the_group_calls_exists():
    """The controller calls HybridWorker methods by name (``ranks.call("name")``,
    ``ranks.fan_out("name")``, ``ranks.forward("name")``, ``ranks.rank0("name")``,
    ``self.optimize("name")``): each must exist (a lost ``def`` line otherwise surfaces only in
    e2e runs)."""
    import re
    from pathlib import Path

    import megarl.actors.ranks as ranks
    import megarl.actors.updates as updates
    import megarl.actors.group as workers
    from megarl.actors.worker import HybridWorker

    text = "".join(Path(m.__file__).read_text() for m in (workers, ranks, updates))
    called = set(re.findall(r'(?:ranks\.|self\.)(?:call|fan_out|forward|rank0|optimize)\("(\w+)"', text))
    assert {"values", "reward_scores", "posttrain_step", "posttrain_eval", "train", "logprobs", "train_critic",
            "info", "attach_engines", "replace_engine", "sync_weights", "advantages", "precision",
            "save_checkpoint", "hash_checkpoint_files", "offload", "onload", "set_config"} <= called, called
    missing = [m for m in called if not callable(getattr(HybridWorker, m, None))]
    assert not missing, missing
