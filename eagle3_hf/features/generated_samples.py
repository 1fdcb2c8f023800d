"""What `regenerate --features-out` (the transformers route) makes of a batch of conversations: each answered
turn by turn by the in-process generator (`run_batch`), then cut into one sample in the GENERATED token ids with
prepare's loss mask (`sample_of`), or refused with the reason the manifest records. The chat-template pieces
around an answer (`Template`) are read here too. Kept apart from the processes that run it
(generation_workers.py) and the command (transformers_generation.py): this is the one place a generated
conversation becomes a training sample.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict, cast

import torch

from ..data.prepare import NoLossTokens, apply_policies, assistant_spans, chat_template_source, turn_end
from ..data.regenerate import ConversationTurns
from ..data.thinking_mode import split_emitted
from ..data.token_boundaries import BoundaryInsideToken, encode, span_mask

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from ..data.regenerate_backends import TransformersBackend
    from ..verifier.generation import FeatureGenerator, Generated

_MARK = "EAGLE3ANSWERMARK"
# (prompt text, its ids, tail ids, tail loss mask): Template.prompt
Prompt = tuple[str, list[int], list[int], list[int]]


class GeneratedSample(TypedDict):
    """One conversation's features, as ShardWriter.add takes them."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_states: torch.Tensor
    last_hidden_state: torch.Tensor
    verifier_greedy: torch.Tensor


class Template:
    """The chat template around an answer: the prompt that asks for it and the tail after it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template_kwargs: dict[str, Any] | None = None) -> None:
        self.tok, self.kwargs = tokenizer, dict(chat_template_kwargs or {})  # the thinking mode, as prepare renders
        self.reasoning = "reasoning_content" in chat_template_source(tokenizer)

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return apply_policies(messages, renders_reasoning=self.reasoning)  # what prepare renders

    def prompt(self, messages: list[dict[str, Any]], tools: list[Any] | None) -> Prompt:
        """(prompt text, its ids, tail ids, tail loss mask) for generating the next turn."""
        msgs = self.messages(messages)
        # tokenize=False: the rendered text
        text = cast(str, self.tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False,
                                                      **self.kwargs))
        full = cast(str, self.tok.apply_chat_template(msgs + [{"role": "assistant", "content": _MARK}], tools=tools,
                                                      tokenize=False, **self.kwargs))
        at = full.find(_MARK, len(text)) if full.startswith(text) else -1
        between = full[len(text):at] if at >= 0 else None
        # the one thing allowed between them: the close of a block the prompt opened (Kimi-K2.5 thinking on renders
        # an answer after `<think></think>`), which the model emits itself after its reasoning
        if between is None or (between and not (text.rstrip().endswith("<think>") and between.strip() == "</think>")):
            raise ValueError("the chat template adds text between the generation prompt and the answer")
        tail = full[at + len(_MARK):]
        ids = encode(self.tok, text)
        tail_ids, tail_mask = span_mask(self.tok, tail, [(0, turn_end(tail))])  # where prepare ends the turn's loss
        return text, ids, tail_ids, tail_mask


def run_batch(convs: list[dict[str, Any]], backend: TransformersBackend, gen: FeatureGenerator, template: Template,
               max_turns: int | None,
               max_seq_len: int | None) -> tuple[list[tuple[dict[str, Any], GeneratedSample | str]], int]:
    """(regenerated row, sample dict or refusal reason) per conversation, turn by turn as `regenerate`,
    and the number of tokens generated."""
    states = [ConversationTurns(c, max_turns) for c in convs]
    last: dict[int, tuple[int, Prompt, Generated]] = {}
    generated = 0
    while True:
        asks = [(k, p) for k, s in enumerate(states) if (p := s.next_prompt()) is not None]
        if not asks:
            break
        pieces: dict[int, Prompt] = {}
        for k, p in asks:
            try:
                pieces[k] = template.prompt(p, convs[k].get("tools"))
            except ValueError as e:
                raise ValueError(f"conversation {convs[k]['id']}: {e}") from None
        results = gen.generate([pieces[k][1] for k, _ in asks], [pieces[k][2] for k, _ in asks])
        for (k, p), r in zip(asks, results):
            text = cast(str, backend.tokenizer.decode(r.answer, skip_special_tokens=True))  # one sequence
            content, reasoning = split_emitted(pieces[k][0], text)  # reasoning after an opened block kept apart
            states[k].accept((content, reasoning, None, r.finish_reason, len(r.answer) + (r.finish_reason == "stop")))
            last[k] = (len(p), pieces[k], r)
            generated += len(r.answer)
    out: list[tuple[dict[str, Any], GeneratedSample | str]] = []
    for k, state in enumerate(states):
        row = state.row(backend.name)
        out.append((row, sample_of(row, convs[k], last.get(k), template, max_seq_len)))
    return out, generated


def sample_of(row: dict[str, Any], conv: dict[str, Any], last: tuple[int, Prompt, Generated] | None,
            template: Template, max_seq_len: int | None) -> GeneratedSample | str:
    """The sample of a regenerated conversation (`row`, from `conv`) out of its last turn's pass (`last`: the
    messages before it, its prompt pieces, what was generated), or the reason it is refused (module docstring)."""
    if last is None:
        return "no_generated_turn"
    n_prompt, (text, _prompt_ids, _tail, tail_mask), r = last
    if len(row["messages"]) != n_prompt + 1:
        return "messages_after_last_turn"
    try:
        _, spans = assistant_spans(template.messages(row["messages"]), template.tok, tools=conv.get("tools"),
                                   template_kwargs=template.kwargs, sample_id=str(conv["id"]))
    except NoLossTokens:
        spans = []
    except ValueError:
        return "template_rewrites_history"
    try:  # earlier turns' spans, as far as they lie in the prompt
        _, prompt_mask = span_mask(template.tok, text, [(a, min(b, len(text))) for a, b in spans if a < len(text)],
                                   str(conv["id"]))
    except BoundaryInsideToken:
        return "boundary_inside_token"
    mask = prompt_mask + [1] * len(r.answer) + tail_mask
    ids = r.input_ids
    if len(ids) != len(mask):
        raise RuntimeError(f"conversation {conv['id']}: {len(ids)} tokens but {len(mask)} mask entries")
    n = len(ids) if max_seq_len is None else min(len(ids), max_seq_len)
    if not any(mask[:n]):
        return "no_loss_tokens"
    # generated with features on
    assert r.aux_hidden_states is not None and r.last_hidden_state is not None and r.verifier_greedy is not None
    return {"input_ids": torch.tensor(ids[:n]), "loss_mask": torch.tensor(mask[:n]),
            "aux_hidden_states": r.aux_hidden_states[:n].float(), "last_hidden_state": r.last_hidden_state[:n].float(),
            "verifier_greedy": r.verifier_greedy[:n]}

