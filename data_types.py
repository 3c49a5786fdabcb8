"""The records that flow through a GRPO step: questions in, scored episodes out."""

from dataclasses import dataclass, field


@dataclass
class QuestionBatch:
    """Questions of one step; `items` are the task's dataset rows (numbers and target, or question and answer)."""

    prompts: list[str]
    prompt_token_ids: list[list[int]]
    items: list[dict]

    @classmethod
    def of_items(cls, items: list[dict]) -> "QuestionBatch":
        return cls([item["prompt"] for item in items], [item["prompt_token_ids"] for item in items], items)


@dataclass
class Episode:
    """One sampled answer to one question, with its score."""

    question_index: int  # which question of the batch: episodes sharing it form a group
    prompt: str
    prompt_token_ids: list[int]
    generated_token_ids: list[int]  # includes the eos token when the episode finished
    text: str  # the generated text, eos included
    is_finished: bool  # stopped on eos rather than at max_gen_len
    reward: float
    reward_info: dict[str, float] = field(default_factory=dict)
    # The sampler's log p and entropy of each generated token (generation.sample_and_score); empty when unknown.
    sampler_log_probs: list[float] = field(default_factory=list)
    sampler_entropies: list[float] = field(default_factory=list)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.generated_token_ids)
