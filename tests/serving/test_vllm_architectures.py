"""Integration tier: the architectures serving/engines/vllm.py says vLLM serves EAGLE-3 and
DFlash drafts for are those whose model class, in the installed vLLM, implements its
SupportsEagle3 interface, no more and no fewer."""

import importlib

import pytest

from serving.engines.vllm import EAGLE3_TARGETS

pytestmark = pytest.mark.integration


def test_the_eagle3_target_list_is_the_installed_vllms():
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    served, unimportable = set(), []
    for architecture, (module, name) in _TEXT_GENERATION_MODELS.items():
        try:
            model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"),
                            name)
        except Exception:  # noqa: BLE001 - some modules need GPU-only packages to import
            unimportable.append(architecture)
            continue
        if supports_eagle3(model):
            served.add(architecture)
    assert served == set(EAGLE3_TARGETS), (sorted(served ^ set(EAGLE3_TARGETS)), unimportable)
    assert {"Gemma3ForCausalLM", "MixtralForCausalLM"} <= set(_TEXT_GENERATION_MODELS) - served
