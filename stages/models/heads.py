"""Heads: the model-side facts of what a method trains (which transformers Auto class builds the model, which
PEFT task type wraps it, whether it generates and how its prompts are laid out). A method names its head
(stages/methods/); the stages that build, adapt, export and run models read the head, never the method."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.engine.errors import ConfigError


@dataclass(frozen=True)
class Head:
    name: str
    auto_class: str  # the transformers Auto class that builds the model
    peft_task_type: str  # peft.TaskType's name
    pipeline_tag: str  # the Hugging Face pipeline tag on the export's card
    generates: bool  # predicts by generation (a generation_config.json ships)
    decoder_only: bool = False  # prompts padded on the left; the prompt comes back before the answer
    encoder_decoder: bool = False  # targets run through a decoder of their own length
    classifies: bool = False  # a classification head: classes, label names, num_labels

    @property
    def auto_peft_class(self) -> str:
        return self.auto_class.replace("AutoModel", "AutoPeftModel")

    def configure(self, config: Any, m: Any) -> None:
        """Set what this head needs on the transformers config before the model is built (a head size)."""
        if self.classifies:
            config.num_labels = m.num_labels or 2


HEADS: dict[str, Head] = {h.name: h for h in (
    Head("seq_cls", "AutoModelForSequenceClassification", "SEQ_CLS", "text-classification", generates=False,
         classifies=True),
    Head("seq2seq", "AutoModelForSeq2SeqLM", "SEQ_2_SEQ_LM", "text2text-generation", generates=True,
         encoder_decoder=True),
    Head("causal_lm", "AutoModelForCausalLM", "CAUSAL_LM", "text-generation", generates=True, decoder_only=True),
)}


def head_named(name: str) -> Head:
    head = HEADS.get(name)
    if head is None:
        raise ConfigError(f"head {name!r} is not one of {', '.join(HEADS)}; a method's head must be one of them")
    return head


def head_of(cfg: Any) -> Head:
    """The head of the pipeline's method (`cfg.method`, its settings, which name their method's head)."""
    return head_named(cfg.method.head)
