"""Tool calls in the model's own chat-template format, and the token ids of tool results.

A multi-turn trajectory is append-only: prompt ids, each model turn's exact sampled ids, then the
ids this module inserts (tool results and the next generation prompt). The model's tokens are
never decoded and re-encoded (BPE is not a bijection) and earlier turns are never re-rendered.

Parsing (:func:`parse_tool_calls`): a call is ``<start>{"name": ..., "arguments": {...}}<end>``
(Hermes format); :func:`tool_call_format` takes the tag pair from the chat template when it writes
a recognisable one, else the Hermes tags. Templates without a JSON object between two tags (Llama
3.1, Mistral's ``[TOOL_CALLS]``, DeepSeek) are not parsed here.

Inserted ids (:class:`TurnFormatter`): the text difference between the template rendered on a
dummy ``[user, assistant]`` and ``[user, assistant, tool...]``, which must be a true suffix; with
``strict=False`` (needed e.g. by Qwen3 without thinking) only the text after the assistant content
must agree. The inserted text follows a special end-of-turn token, so tokenizing it alone gives
the in-context ids; tool output holding special-token text is tokenized with specials split.
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

__all__ = [
    "HERMES",
    "ParsedTurn",
    "ToolCall",
    "ToolCallFormat",
    "TurnFormatter",
    "parse_tool_calls",
    "tool_call_format",
    "tools_system_prompt",
]


@dataclass(frozen=True)
class ToolCallFormat:
    """The tags around one tool call's JSON object."""

    start: str
    end: str

    def __post_init__(self):
        if not self.start or not self.end or self.start == self.end:
            raise ValueError(f"ToolCallFormat needs two different non-empty tags, got start={self.start!r} "
                             f"end={self.end!r}")


HERMES = ToolCallFormat("<tool_call>", "</tool_call>")


@dataclass
class ToolCall:
    name: str
    arguments: dict
    raw: str
    """The whole block, tags included, as it appears in the turn's text."""


@dataclass
class ParsedTurn:
    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in the order they appear."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call block, in order (``tool call <k>: ...``, k counts all blocks)."""
    final_text: str = ""
    """The turn's text without the call blocks (malformed and unclosed ones too), ends stripped."""


# --------------------------------------------------------------------------------------------
# tool-call tags of a chat template

_TAG_RE = re.compile(r"<(\|?)(/?)([A-Za-z_]*tool_?call[A-Za-z_]*)(\|?)>", re.IGNORECASE)


def tool_call_format(chat_template: Optional[str]) -> ToolCallFormat:
    """The tool-call tags the template writes, else :data:`HERMES`.

    Every ``<name>``/``<|name|>`` tag whose name contains ``tool_call`` is a candidate opening tag;
    its closing tag is ``</name>``/``<|/name|>`` or, for ``..._begin``/``..._start`` names, the
    ``..._end`` one. The pair must both occur in the template. Singular ``tool_call`` names win over
    wrappers such as ``<|tool_calls_begin|>`` (which surround several calls)."""
    if not chat_template:
        return HERMES
    if isinstance(chat_template, dict):   # named templates (tokenizer_config "chat_template" list)
        chat_template = chat_template.get("tool_use") or chat_template.get("default") or ""
    tags = {m.group(0) for m in _TAG_RE.finditer(chat_template)}
    openings = []
    for m in _TAG_RE.finditer(chat_template):
        bar_open, slash, name, bar_close = m.groups()
        if slash or name.lower().endswith("_end"):
            continue
        ends = [f"<{bar_open}/{name}{bar_close}>", f"<{bar_open}{name}_end{bar_close}>"]
        stem = re.sub(r"_(begin|start)$", "", name, flags=re.IGNORECASE)
        if stem != name:
            ends.insert(0, f"<{bar_open}{stem}_end{bar_close}>")
        rank = (name.lower() not in ("tool_call", "toolcall"), "calls" in name.lower(), m.start())
        openings.append((rank, m.group(0), ends))
    for _, start, ends in sorted(openings):
        for end in ends:
            if end in tags:
                return ToolCallFormat(start, end)
    return HERMES


# --------------------------------------------------------------------------------------------
# parsing

def _strip_fence(body: str) -> str:
    """``` ```json\\n{...}\\n``` ``` -> ``{...}`` (small models often fence the JSON)."""
    if body.startswith("```") and body.endswith("```") and len(body) >= 6:
        body = body[3:-3]
        first_newline = body.find("\n")
        if first_newline >= 0 and not body[:first_newline].strip().startswith("{"):
            body = body[first_newline + 1:]
    return body.strip()


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def _decode_call(body: str, raw: str) -> tuple[Optional[ToolCall], Optional[str]]:
    body = _strip_fence(body.strip())
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return None, f"bad JSON ({e.msg} at char {e.pos}): {_short(body)}"
    if not isinstance(obj, dict):
        return None, (f"expected a JSON object {{\"name\": ..., \"arguments\": {{...}}}}, "
                      f"got {type(obj).__name__}: {_short(body)}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return None, f"missing or invalid \"name\" (expected a non-empty string, got {_short(json.dumps(name))})"
    # "parameters" is the Llama 3.1 spelling; a call without arguments means no arguments
    arguments: Any = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            decoded = json.loads(arguments)
        except json.JSONDecodeError:
            decoded = None
        if not isinstance(decoded, dict):
            return None, f"\"arguments\" of {name!r} is a string that is not a JSON object: {_short(arguments)}"
        arguments = decoded
    if not isinstance(arguments, dict):
        return None, f"\"arguments\" of {name!r} must be a JSON object, got {type(arguments).__name__}"
    return ToolCall(name=name, arguments=arguments, raw=raw), None


def parse_tool_calls(text: str, fmt: ToolCallFormat = HERMES) -> ParsedTurn:
    """The tool calls of one model turn's text, in order, with one error per malformed block.

    A block opened and not closed before the end of the text, or before the next opening tag, is
    ``unclosed``; parsing resumes at that next opening tag. A JSON string ``"arguments"`` that
    decodes to an object is accepted (some models double-encode)."""
    calls, errors, kept = [], [], []
    pos, index = 0, 0
    while True:
        start = text.find(fmt.start, pos)
        if start < 0:
            kept.append(text[pos:])
            break
        kept.append(text[pos:start])
        index += 1
        body_start = start + len(fmt.start)
        end = text.find(fmt.end, body_start)
        next_start = text.find(fmt.start, body_start)
        if end < 0 or 0 <= next_start < end:
            where = "the end of the turn" if end < 0 else f"the next {fmt.start}"
            errors.append(f"tool call {index}: unclosed {fmt.start} (no {fmt.end} before {where}): "
                          f"{_short(text[start:next_start if end >= 0 else len(text)])}")
            if end < 0:
                break
            pos = next_start
            continue
        raw = text[start:end + len(fmt.end)]
        call, error = _decode_call(text[body_start:end], raw)
        if call is not None:
            calls.append(call)
        else:
            errors.append(f"tool call {index}: {error}")
        pos = end + len(fmt.end)
    return ParsedTurn(calls=calls, errors=errors, final_text="".join(kept).strip())


# --------------------------------------------------------------------------------------------
# token ids to insert

_USER = "MEGARL_PROBE_USER"
_MARK = "MEGARL_PROBE_ASSISTANT"
# The plain dummy turn, then one with a reasoning block (templates such as Qwen3's render an empty
# <think></think> on the last assistant turn only, but keep a non-empty one on every turn).
_DUMMIES = (_MARK, "<think>\nMEGARL_PROBE_REASONING\n</think>\n\n" + _MARK)
_PROBE_RESULT = ("megarl_probe_tool", "MEGARL_PROBE_RESULT")


def tools_system_prompt(tools_schema: Sequence[dict], fmt: ToolCallFormat = HERMES) -> str:
    """System text describing the tools and the call format, for templates without ``tools``."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools_schema)
    return (
        "You can use the tools described below (JSON schemas, one per line):\n"
        f"<tools>\n{listing}\n</tools>\n\n"
        "To use a tool, write one JSON object with the tool's name and its arguments between "
        f"{fmt.start} and {fmt.end}, like this:\n"
        f'{fmt.start}\n{{"name": "<tool name>", "arguments": {{"<argument>": <value>}}}}\n{fmt.end}\n'
        "You may call several tools in one turn. The results come back in the next message. "
        "When you do not need a tool, answer directly."
    )


class TurnFormatter:
    """Prompt ids with the tools, and the ids to insert after a model turn that called tools.

    ``tokenizer``: a transformers tokenizer with a chat template. ``tools_schema``: the tools as
    OpenAI-style JSON schemas (``{"type": "function", "function": {"name", "description",
    "parameters"}}``). ``template_kwargs`` go to every rendering (e.g. ``enable_thinking``).
    ``strict``: see the module docstring.

    Attributes: ``supports_tools`` (the template renders ``tools``; otherwise the tools go in a
    system message, :func:`tools_system_prompt`), ``call_format`` (the tags to parse: the
    template's own when it supports tools, else Hermes, which the system message teaches),
    ``end_of_turn_ids`` (the template's end-of-turn token, e.g. ``<|im_end|>``: give it to the
    sampler as a stop token, since vLLM stops on the tokenizer's eos, which can be another token)
    and ``prefix_stable`` (the strict check passed)."""

    def __init__(self, tokenizer, tools_schema: Optional[list[dict]] = None, *,
                 template_kwargs: Optional[dict] = None, strict: bool = True):
        self.strict = strict
        template = getattr(tokenizer, "chat_template", None)
        self.name = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or type(tokenizer).__name__!r}"
        if not template:
            raise ValueError(f"{self.name}: the tokenizer has no chat_template; the agent loop needs one "
                             "(set tokenizer.chat_template or use an instruct model)")
        self.tokenizer = tokenizer
        self.tools_schema = list(tools_schema or [])
        self.template_kwargs = dict(template_kwargs or {})
        probe_tools = self.tools_schema or [{"type": "function", "function": {
            "name": "megarl_probe_tool", "description": "MEGARL_PROBE_TOOL",
            "parameters": {"type": "object", "properties": {}}}}]
        user = [{"role": "user", "content": _USER}]
        self.supports_tools = self._render(user, True, tools=probe_tools) != self._render(user, True)
        self.call_format = tool_call_format(template) if self.supports_tools else HERMES
        if self.supports_tools and self.call_format == HERMES and HERMES.start not in str(template):
            warnings.warn(f"{self.name} renders tools but writes no recognisable tool-call tags; parsing "
                          f"expects {HERMES.start}...{HERMES.end}, which its prompt may not teach", stacklevel=2)
        self._special = [t for t in self._special_tokens() if t]
        self._probe()
        if self.tools_schema and not self.supports_tools:
            listing = json.dumps(self.tools_schema[0], ensure_ascii=False)
            if listing not in self.prompt_text(user):
                raise ValueError(f"{self.name} renders neither `tools` nor a system message, so the tools "
                                 "cannot be described to the model")

    # -- rendering -------------------------------------------------------------------------------

    def _render(self, messages: list[dict], add_generation_prompt: bool, tools=None) -> str:
        kwargs = dict(self.template_kwargs)
        if tools:
            kwargs["tools"] = tools
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **kwargs)
        except Exception as e:   # jinja TemplateError, raise_exception() in the template, ...
            roles = [m["role"] for m in messages]
            raise ValueError(f"{self.name} failed to render a conversation with roles {roles}: "
                             f"{type(e).__name__}: {e}") from e

    def _special_tokens(self) -> list[str]:
        decoder = getattr(self.tokenizer, "added_tokens_decoder", {}) or {}
        specials = {t.content for t in decoder.values() if getattr(t, "special", False)}
        specials.update(getattr(self.tokenizer, "all_special_tokens", []) or [])
        return sorted(specials, key=len, reverse=True)

    @staticmethod
    def _tool_messages(results: Sequence[tuple[str, str]]) -> list[dict]:
        return [{"role": "tool", "name": name, "content": content} for name, content in results]

    def _encode(self, text: str, split_special_tokens: bool = False) -> list[int]:
        if not text:
            return []
        return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=split_special_tokens))

    @staticmethod
    def _after_mark(text: str) -> Optional[str]:
        i = text.rfind(_MARK)
        return None if i < 0 else text[i + len(_MARK):]

    def _probe(self) -> None:
        """Find the end-of-turn token and check that a tool turn renders as an append."""
        user = [{"role": "user", "content": _USER}]
        prompt = self._render(user, True)
        tools = self._tool_messages([_PROBE_RESULT])
        failures = []
        for dummy in _DUMMIES:
            turn = user + [{"role": "assistant", "content": dummy}]
            base, full = self._render(turn, False), self._render(turn + tools, True)
            if not base.startswith(prompt + dummy):
                failures.append(f"assistant {dummy!r} is not rendered verbatim after the generation prompt")
            elif not full.startswith(base):
                failures.append(f"with assistant {dummy!r}, the rendering without the tool message is not a "
                                "prefix of the rendering with it")
            else:
                self.prefix_stable, self._dummy, self._base = True, dummy, base
                self._tail = base[len(prompt) + len(dummy):]
                break
        else:
            message = (f"{self.name} does not render a tool turn as an append to the text before it, so tool "
                       f"results cannot be inserted after the sampled ids ({'; '.join(failures)})")
            if self.strict:
                raise ValueError(message + "; strict=False accepts a template that only re-renders earlier "
                                 "turns, when the text after the assistant turn agrees")
            turn = user + [{"role": "assistant", "content": _MARK}]
            tail = self._after_mark(self._render(turn, False))
            tail_full = self._after_mark(self._render(turn + tools, True))
            if tail is None or tail_full is None or not tail_full.startswith(tail):
                raise ValueError(message + "; the text after the assistant turn differs too (strict=False)")
            warnings.warn(message + "; strict=False: trajectories are append-only, so they differ from the "
                          "template's rendering of the finished conversation", stacklevel=3)
            self.prefix_stable, self._dummy, self._base, self._tail = False, _MARK, None, tail
        eot = next((s for s in self._special if self._tail.startswith(s)), None)
        if eot is None:
            raise ValueError(f"{self.name}: no special end-of-turn token right after the assistant text (the "
                             f"template writes {self._tail[:40]!r} there); cannot tell where a model turn ends")
        self.end_of_turn_text = eot
        self.end_of_turn_ids = self._encode(eot)
        inserted = self._inserted_text([_PROBE_RESULT])
        if _PROBE_RESULT[1] not in inserted:
            raise ValueError(f"{self.name} does not render the content of role 'tool' messages (it renders "
                             f"{inserted!r} for a tool message {_PROBE_RESULT[1]!r})")

    def _inserted_text(self, results: Sequence[tuple[str, str]]) -> str:
        """The text after the end-of-turn token: separator, tool messages, generation prompt."""
        turn = [{"role": "user", "content": _USER}, {"role": "assistant", "content": self._dummy}]
        full = self._render(turn + self._tool_messages(results), True)
        if self.prefix_stable:
            if not full.startswith(self._base):
                raise ValueError(f"{self.name}: the rendering with tool results {[n for n, _ in results]} no longer "
                                 "starts with the assistant turn it follows")
            rest = full[len(self._base):]
        else:
            after = self._after_mark(full)
            if after is None or not after.startswith(self._tail):
                raise ValueError(f"{self.name}: the text after the assistant turn changes with tool results "
                                 f"{[n for n, _ in results]}")
            rest = after[len(self._tail):]
        return self._tail[len(self.end_of_turn_text):] + rest

    # -- public ----------------------------------------------------------------------------------

    def prompt_messages(self, messages) -> list[dict]:
        """``messages`` (a string is one user message) with the tools' system message when the
        template does not render ``tools`` (appended to a leading system message, else inserted)."""
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        messages = [dict(m) for m in messages]
        if self.tools_schema and not self.supports_tools:
            text = tools_system_prompt(self.tools_schema, HERMES)
            if messages and messages[0].get("role") == "system":
                messages[0]["content"] = (messages[0]["content"].rstrip() + "\n\n" + text).lstrip()
            else:
                messages.insert(0, {"role": "system", "content": text})
        return messages

    def prompt_text(self, messages) -> str:
        """The first prompt as text: the template with the tools, and the generation prompt."""
        tools = self.tools_schema if self.supports_tools else None
        return self._render(self.prompt_messages(messages), True, tools=tools)

    def prompt_ids(self, messages) -> list[int]:
        """Token ids of :meth:`prompt_text` (special tokens in the text are special, as in the
        template's own tokenization; no extra BOS: the template writes it when it wants one)."""
        return self._encode(self.prompt_text(messages))

    def ends_turn(self, ids: Sequence[int]) -> bool:
        """True when the sampled ``ids`` end with the end-of-turn token."""
        k = len(self.end_of_turn_ids)
        return len(ids) >= k and list(ids[-k:]) == self.end_of_turn_ids

    def tool_turn_ids(self, results: Sequence[tuple[str, str]], turn_ended: bool) -> list[int]:
        """The ids to append after a model turn that called tools.

        ``results``: ``(tool name, content)`` per call, in call order (one tool message each).
        ``turn_ended``: the sampled ids already end with :attr:`end_of_turn_ids`; if not (a stop
        string, a length limit) they come first. Then the template's text between an assistant
        turn and the next message (``"\\n"`` in ChatML), the tool messages and the assistant
        generation prompt, tokenized on their own. A content that holds special-token text is
        rendered as a placeholder and tokenized with special tokens split."""
        if not results:
            raise ValueError("tool_turn_ids needs at least one (name, content) result")
        rendered, contents = [], {}
        for k, result in enumerate(results):
            if not (isinstance(result, (tuple, list)) and len(result) == 2 and all(isinstance(x, str) for x in result)):
                raise TypeError(f"tool result {k} must be a (name: str, content: str) pair, got {result!r}")
            name, content = result
            if any(s in content for s in self._special):
                placeholder = f"MEGARL_TOOL_CONTENT_{k}_"
                contents[placeholder] = content
                content = placeholder
            rendered.append((name, content))
        text = self._inserted_text(rendered)
        ids = [] if turn_ended else list(self.end_of_turn_ids)
        if not contents:
            return ids + self._encode(text)
        pos, seen = 0, []
        for m in re.finditer("|".join(map(re.escape, contents)), text):
            ids += self._encode(text[pos:m.start()]) + self._encode(contents[m.group()], split_special_tokens=True)
            seen.append(m.group())
            pos = m.end()
        if sorted(seen) != sorted(contents):
            raise ValueError(f"{self.name} does not render tool contents verbatim, so a result holding special-token "
                             "text cannot be tokenized safely")
        return ids + self._encode(text[pos:])
