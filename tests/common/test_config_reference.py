"""docs/configuration.md holds the reference generated from the config schema, unchanged."""

from __future__ import annotations

from pathlib import Path

from blockspec.common.config import BlockspecConfig
from blockspec.common.config_reference import reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- BEGIN generated: blockspec config --reference -->\n", "<!-- END generated -->"


def test_the_doc_holds_the_generated_reference():
    text = DOC.read_text()
    generated = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    assert generated.strip() == reference().strip(), "run: blockspec config --reference, and paste it into the doc"


def test_every_key_of_the_schema_is_in_the_reference():
    def keys(model, prefix):
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and hasattr(annotation, "model_fields"):
                yield from keys(annotation, f"{prefix}{name}.")
            elif name != "tenants":
                yield f"{prefix}{name}"

    text = reference()
    missing = [k for k in keys(BlockspecConfig, "") if f"`{k}`" not in text]
    assert missing == [] and "`server.rate_limit.tenants.NAME.tokens_per_day`" in text
    assert "| `model.spec_decode.num_speculative_tokens` | integer | `5` | >= 1, <= 16 |" in text
