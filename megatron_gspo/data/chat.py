"""Chat formatting with a Hugging Face tokenizer directory's own chat template.

Instruct models are trained on prompts in their chat format. ``data.chat_template: true``
renders each prompt as a user message (after ``data.system_prompt`` if set) with the
``chat_template`` of ``data.tokenizer``'s ``tokenizer_config.json`` (or its
``chat_template.jinja``) and ``add_generation_prompt``, in a sandboxed Jinja environment as
transformers does; ``data.chat_template_kwargs`` reach the template (e.g. Qwen3's
``enable_thinking``).
"""

from __future__ import annotations

import json
from pathlib import Path

from megatron_gspo.runtime.errors import InputError

__all__ = ["ChatTemplate"]


class ChatTemplate:
    def __init__(self, tokenizer_path: str | Path, *, system_prompt: str | None, kwargs: dict):
        path = Path(tokenizer_path)
        directory = path if path.is_dir() else path.parent
        template, config = self._find(directory)
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(template)
        self._special = {
            f"{k}_token": _content(config.get(f"{k}_token")) for k in ("bos", "eos", "pad")
        }
        self.system_prompt, self.kwargs, self.where = system_prompt, dict(kwargs), directory

    @staticmethod
    def _find(directory: Path) -> tuple[str, dict]:
        cfg_path = directory / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        jinja = directory / "chat_template.jinja"
        if not template and jinja.is_file():
            template = jinja.read_text()
        if not template:
            raise InputError(
                f"data.chat_template: {directory} has no chat template (tokenizer_config.json "
                "'chat_template' or chat_template.jinja)"
            )
        return template, config

    def render(self, prompt: str) -> str:
        """A prompt as the first user message (after the system prompt), ready for the
        assistant's answer."""
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return self.render_messages(messages, add_generation_prompt=True)

    def render_messages(self, messages: list[dict], *, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **self._special,
            **self.kwargs,
        )


def _content(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
