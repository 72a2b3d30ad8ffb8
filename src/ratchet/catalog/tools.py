"""Which tool class a tool config's `class_name` means: ratchet's own tools by short name,
the verl classes they stand in for, or a tool of your own ('package.module:Class' or
'path/to/file.py:Class'). Torch-free, so the config schema checks names at submit time."""

from __future__ import annotations

from ratchet.user_code import UserCodeError, import_user_module

from .registry import Registry

# class_name -> "module:Class" (several names may mean one class: a short name, the full
# one, and verl's name for what ratchet's class stands in for)
TOOL_CLASSES: Registry[str] = Registry("tool class")
for _names, _target in (
    (("calculator", "ratchet.tools.calculator.Calculator"), "ratchet.tools.calculator:Calculator"),
    (("code_runner", "ratchet.tools.code_runner.CodeRunner"), "ratchet.tools.code_runner:CodeRunner"),
    # verl's remote code tool: a client of a SandboxFusion server at config.sandbox_fusion_url.
    (
        ("sandbox_fusion", "ratchet.tools.sandbox_fusion.SandboxFusionTool", "verl.tools.sandbox_fusion_tools.SandboxFusionTool"),
        "ratchet.tools.sandbox_fusion:SandboxFusionTool",
    ),
):
    for _name in _names:
        TOOL_CLASSES.register(_name, _target)


def is_import_path(class_name: str) -> bool:
    """'package.module:Class' or 'path/to/file.py:Class': a tool of the user's own."""
    target, sep, attr = class_name.rpartition(":")
    return bool(sep and target and attr.isidentifier())


def check_class_name(class_name: object, where: str) -> str:
    if not isinstance(class_name, str) or not class_name:
        raise ValueError(f"{where}: class_name must be a non-empty string, got {class_name!r}")
    if class_name in TOOL_CLASSES or is_import_path(class_name):
        return class_name
    raise ValueError(
        f"{where}: unknown tool class {class_name!r}; known: {', '.join(TOOL_CLASSES)}; "
        "or name a tool of your own as 'package.module:Class' or 'path/to/file.py:Class'"
    )


def resolve_class(class_name: str, where: str = "class_name") -> type:
    """The class `class_name` names (imported now); ValueError saying what is wrong."""
    spec = TOOL_CLASSES.entries.get(class_name, class_name)
    check_class_name(class_name, where)
    target, _, attr = spec.rpartition(":")
    try:
        module = import_user_module(target, "ratchet_user_tool")
    except UserCodeError as exc:
        raise ValueError(f"{where}: {exc}") from None
    cls = getattr(module, attr, None)
    if cls is None:
        raise ValueError(f"{where}: {target} has no attribute {attr!r}")
    return cls
