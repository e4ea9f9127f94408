"""docs/configuration.md's reference of every key is the one the code generates, and every
key is documented there."""

import dataclasses
import typing

from recipe import config
from recipe.reference import DOC, field_docs, with_reference


def test_the_configuration_reference_in_the_docs_is_current():
    document = DOC.read_text()
    assert with_reference(document) == document, (
        "docs/configuration.md's key reference is out of date: run "
        "`python -m recipe.reference --write`")


def test_every_config_key_has_a_docstring():
    missing = [f"{section}.{f.name}"
               for section, cls in typing.get_type_hints(config.Config).items()
               for f in dataclasses.fields(cls) if not field_docs(cls).get(f.name)]
    assert not missing, f"document these fields under their definition: {missing}"
