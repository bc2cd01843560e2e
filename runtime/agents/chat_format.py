"""The chat template, for conversations: the first prompt with the tools rendered in, and after each
model turn the tokens that close it and open the next (tool results in the template's tool role, or an
environment's observation as a user turn), ending with the assistant's generation prompt.

Appended tokens come from the template itself: a stand-in conversation is rendered with and without the
new messages, and the difference (plus what the template writes after an assistant turn's text, minus
the end-of-turn token the model already generated) is tokenized. The model's own tokens are never
re-tokenized, so what is trained on is exactly what was sampled.

`check_template` (torch-free) says in one line when a template cannot show tools (it never reads `tools`)
or cannot render a tool turn.
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.simulator.errors import HflowError

MARK = "\u2063hflow-turn\u2063"  # stand-in assistant text, never produced by a template


def template_reads_tools(template: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return False


def check_template(folder: str | Path, needs_tools: bool) -> None:
    """One line when the model folder's chat template cannot run tool conversations (torch-free)."""
    from hybridflow.runtime.tasks.token_count import chat_template_of

    template = chat_template_of(folder)
    if template is None:
        raise HflowError(f"{folder}: its tokenizer has no chat template; an agent rollout needs one (with tool "
                         "support for agent.tools), in tokenizer_config.json or chat_template.jinja")
    if needs_tools and not template_reads_tools(template):
        raise HflowError(f"{folder}: its chat template does not render tools (it never reads `tools`); use a "
                         "template with tool support (e.g. Qwen2.5's, Hermes') or an agent.environment instead")


class ChatFormat:
    """A transformers tokenizer with its chat template, and the tools' schemas shown to the model."""

    def __init__(self, hf_tokenizer, tools: list[dict] | None = None, eos_ids: list[int] | None = None):
        self.hf = hf_tokenizer
        self.tools = tools or None
        self.eos_ids = list(eos_ids or [hf_tokenizer.eos_token_id])
        s1 = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}], False)
        # what the template writes after an assistant turn's text (its end-of-turn token, a newline, …)
        self.after_turn = s1[s1.rindex(MARK) + len(MARK):]

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        try:
            return self.hf.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                               tokenize=False)
        except Exception as e:
            raise HflowError(f"the chat template failed on a {messages[-1]['role']} turn "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); use a template "
                             "that renders tool and user turns after an assistant turn") from None

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        text = self._render(messages, True)
        return list(self.hf(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def next_turn_ids(self, messages: list[dict], ended_with: int | None) -> list[int]:
        """Tokens after a model turn (whose last token was `ended_with`) up to the next generation prompt,
        with `messages` (tool or user turns) between."""
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": MARK}]
        s1, s2 = self._render(base, False), self._render(base + messages, True)
        if not s2.startswith(s1):
            raise HflowError("the chat template renders earlier turns differently once a tool or user turn "
                             "follows; multi-turn rollouts need a template that only appends")
        tail = self.after_turn
        if ended_with is not None and ended_with in self.eos_ids:
            eos_text = self.hf.convert_ids_to_tokens(ended_with)
            tail = tail[len(eos_text):] if tail.startswith(eos_text) else tail
        return list(self.hf(tail + s2[len(s1):], add_special_tokens=False)["input_ids"])
