"""An environment's turn as the token ids that follow a model turn.

With a chat template (``data.chat_template``), an observation becomes a message of
``rollout.multi_turn.observation_role`` (``user``, or ``tool`` for tool results), wrapped in the
template's own text: what the template writes after an assistant message's stop token, the new
message, and the next assistant turn's generation prompt. That glue is read off the template
once, by rendering a probe conversation with and without the new message; the model's turn,
already ids, is never rendered or tokenized again. Without a chat template the observation's
text is tokenized as it is.
"""

from __future__ import annotations

from megatron_gspo.data.chat import ChatTemplate
from megatron_gspo.data.tokenizer import Tokenizer
from megatron_gspo.runtime.errors import InputError

__all__ = ["TurnRenderer", "chat_glue"]

# Probe contents no template writes itself (invisible separators).
_PROBE_ANSWER, _PROBE_OBSERVATION = "\u2062", "\u2063"


def chat_glue(chat: ChatTemplate, role: str, stop_text: str) -> tuple[str, str]:
    """The text a chat template puts before and after an observation of ``role`` that follows
    a model turn ending in ``stop_text`` (the stop token the model sampled)."""
    history = [
        {"role": "user", "content": "question"},
        {"role": "assistant", "content": _PROBE_ANSWER},
    ]
    base = chat.render_messages(history, add_generation_prompt=False)
    full = chat.render_messages(
        history + [{"role": role, "content": _PROBE_OBSERVATION}], add_generation_prompt=True
    )
    where = f"the chat template of {chat.where}"
    if not full.startswith(base) or _PROBE_ANSWER not in base:
        raise InputError(
            f"{where} renders earlier messages differently once a {role!r} message follows; "
            "environment turns cannot be appended as ids"
        )
    after_answer = base[base.rindex(_PROBE_ANSWER) + 1 :]
    if not after_answer.startswith(stop_text):
        raise InputError(
            f"{where} ends an assistant message with {after_answer!r}, not with the stop token "
            f"{stop_text!r} the model ends its turn with (rollout.stop_token_ids)"
        )
    before, after = full[len(base) :].split(_PROBE_OBSERVATION)
    return after_answer[len(stop_text) :] + before, after


class TurnRenderer:
    """``renderer(text) -> ids`` for an environment turn."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat: ChatTemplate | None = None,
        *,
        role: str = "user",
        stop_text: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.before = self.after = ""
        if chat is not None:
            if stop_text is None:
                raise InputError("a chat template's turns need the stop token's text")
            self.before, self.after = chat_glue(chat, role, stop_text)

    def __call__(self, observation: str) -> list[int]:
        return self.tokenizer.encode(self.before + observation + self.after)
