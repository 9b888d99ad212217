"""generations.jsonl and `megarl samples`: which samples are logged (best, worst, ...), what a
record holds (decoded prompt and response with special tokens, ids, vLLM's log-probs, reward,
length, version gap; agent turns in order), the printout's order, and resume."""
import io

from helpers import read_jsonl

from megarl.observability.generations import GenerationLog, main, pick_samples
from megarl.data.batch import Rollout, TokenVersions


class Tok:
    """decode: one letter per id (0 -> '<s>'), so text and ids map both ways."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join("<s>" if i == 0 else chr(ord("a") + i - 1) for i in ids)


def rollout(rewards, masks=None):
    n = len(rewards)
    r = Rollout([[0, 1, 2]] * n, [[3 + i, 4] for i in range(n)], [[-1.0, -1.0]] * n, [0] * n, [""] * n, [False] * n,
                rewards=list(rewards), sample_ids=[f"s2.g0.{i}" for i in range(n)],
                token_versions=[TokenVersions([(1, 2)])] * n, loss_masks=masks or [])
    return r


def test_pick_best_then_worst_alternating():
    assert pick_samples([0.5, 1.0, 0.0, 1.0, 0.2], 2) == [1, 2]
    assert pick_samples([0.5, 1.0, 0.0, 1.0, 0.2], 4) == [1, 2, 3, 4]
    assert pick_samples([0.5, 1.0], 5) == [1, 0]


def test_records_turns_cli_and_resume(tmp_path):
    texts = []
    log = GenerationLog(tmp_path, Tok(), 2, resume_step=1, table_sink=lambda step, rows: texts.append((step, len(rows))))
    log.write(2, rollout([0.5, 1.0, 0.0]))
    [line] = read_jsonl(tmp_path / "generations.jsonl")
    assert line["step"] == 2 and [s["id"] for s in line["samples"]] == ["s2.g0.1", "s2.g0.2"]
    best = line["samples"][0]
    assert best == {"id": "s2.g0.1", "reward": 1.0, "length": 2, "gap": 0, "prompt": "<s>ab", "response": "dd",
                    "response_ids": [4, 4], "prompt_ids": [0, 1, 2], "logprobs": [-1.0, -1.0]}
    assert texts == [(2, 2)]
    # an agent trajectory: model tokens, the inserted tool result, model tokens again
    agent = rollout([1.0])
    agent.response_ids, agent.loss_masks = [[5, 6, 9, 9, 7]], [[True, True, False, False, True]]
    log.write(3, agent)
    out = io.StringIO()
    assert main(str(tmp_path), stream=out) == 0   # the last step
    text = out.getvalue()
    assert text.index("--- model (2 tokens) ---\nef") < text.index("--- tool (2 tokens) ---\nii") < \
        text.index("--- model (1 tokens) ---\ng")
    out = io.StringIO()
    assert main(str(tmp_path), step=2, order="worst", stream=out) == 0
    assert out.getvalue().index("reward 0 ") < out.getvalue().index("reward 1 ")
    assert main(str(tmp_path), step=9, stream=io.StringIO()) == 1
    # resume from step 3: step 3's line is dropped, step 2's kept
    GenerationLog(tmp_path, Tok(), 2, resume_step=3)
    assert [row["step"] for row in read_jsonl(tmp_path / "generations.jsonl")] == [2]
    # off
    GenerationLog(tmp_path / "off", Tok(), 0, resume_step=1).write(1, rollout([1.0]))
    assert not (tmp_path / "off" / "generations.jsonl").exists()
    # logging.samples_every=2: steps 2, 4, ... only
    (tmp_path / "every").mkdir()
    every = GenerationLog(tmp_path / "every", Tok(), 1, resume_step=1, every=2)
    for step in (1, 2, 3):
        every.write(step, rollout([1.0]))
    assert [row["step"] for row in read_jsonl(tmp_path / "every" / "generations.jsonl")] == [2]
