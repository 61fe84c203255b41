"""The sample a reward function sees: the prompt (text and chat messages), the response (text and token ids), the
reference answer, the row's data_source and every column of its row."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Sample:
    """One response to score, with everything its prompt's row held."""

    prompt: str
    """The prompt text as the engine saw it (chat template applied)."""
    prompt_messages: list[dict] | None
    """The row's chat messages (None: a plain-text prompt)."""
    response: str
    """The decoded response, special tokens skipped."""
    response_ids: list[int]
    answer: str | None
    """The reference answer (verl: reward_model.ground_truth); None when the row has none."""
    data_source: str = ""
    """The row's data_source (verl); "" when it has none."""
    row: dict = field(default_factory=dict)
    """Every column of the row, as read."""
    where: str = ""
    """Where the prompt came from ("file:row N", "toy:3"), for error messages."""


def samples_of(prompts: list, prompt_index, texts: list[str], response_ids) -> list[Sample]:
    """The Samples of a batch of responses: response j answers `prompts[prompt_index[j]]` (moe_rl.data.prompts.Prompt
    objects), `texts[j]` is its decoded text and `response_ids[j]` its token ids."""
    out = []
    for j, i in enumerate(prompt_index):
        p = prompts[int(i)]
        ids = response_ids[j]
        out.append(
            Sample(
                prompt=p.text,
                prompt_messages=p.messages,
                response=texts[j],
                response_ids=ids.tolist() if hasattr(ids, "tolist") else list(ids),
                answer=p.answer,
                data_source=p.data_source,
                row=p.row,
                where=p.source,
            )
        )
    return out
