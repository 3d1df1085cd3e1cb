"""Token ids for the environment's side of a conversation, through the tokenizer's chat template.

The prompt is the row's messages (``reset``'s text appended to the last user message, the tools' schemas given
to the template). A reply (tool results, or a ``step`` environment's next user message) is rendered the way
TRL renders a tool suffix: the template applied to a dummy exchange plus the reply with a generation prompt,
minus the dummy exchange up to its last EOS. The suffix therefore holds the template's markup between the
model's end-of-turn and the next assistant header, and the model continues exactly as it would after the
whole conversation were rendered at once. A turn that ended without EOS (its token budget ran out, or a stop
string) gets the EOS prepended, closing the model's turn as the template would.
"""

from __future__ import annotations

from typing import Any

_DUMMY = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]


class ChatRenderer:
    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None, **template_kwargs: Any) -> None:
        if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("an environment needs a tokenizer with a chat template (to render its messages); "
                             "set model.tokenizer to one")
        self.tok, self.tools, self.kwargs = tokenizer, tools or None, template_kwargs
        self.eos = tokenizer.eos_token_id
        prefix = self._ids(_DUMMY, generation_prompt=False)
        ends = [i for i, t in enumerate(prefix) if t == self.eos]
        self.closes_with_eos = bool(ends)
        self.prefix = prefix[: ends[-1] + 1] if ends else prefix

    def _ids(self, messages: list[dict[str, Any]], generation_prompt: bool, tools: Any = None) -> list[int]:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                            tools=tools, **self.kwargs)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, prompt: str | list[dict[str, Any]], reset_text: str | None) -> tuple[str, list[int]]:
        """(text, ids) of the first turn's prompt: ``reset``'s string appended to the last user message."""
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if reset_text:
            users = [i for i, m in enumerate(messages) if m.get("role") == "user"]
            if not users:
                messages.append({"role": "user", "content": reset_text})
            else:
                last = messages[users[-1]]
                last["content"] = f"{last['content']}{reset_text}"
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, tools=self.tools,
                                            **self.kwargs)
        return text, list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def reply(self, messages: list[dict[str, Any]], last_model_token: int | None) -> list[int]:
        """The tokens between the model's turn and its next one: the reply's messages and the assistant header."""
        full = self._ids(_DUMMY + messages, generation_prompt=True)
        if full[: len(self.prefix)] != self.prefix:
            raise ValueError("the chat template renders a conversation whose start is not the rendering of its "
                             "first messages; its replies cannot be appended as tokens")
        ids = full[len(self.prefix):]
        if self.closes_with_eos and last_model_token != self.eos:
            ids = [self.eos, *ids]
        return ids
