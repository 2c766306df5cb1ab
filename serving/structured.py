"""Structured output in the OpenAI API: `response_format`, `guided_regex` / `guided_choice`
(vLLM's names), and forced tool calls (`tools` with `tool_choice` "required" or a named
function), each turned into one `models.grammar.GrammarSpec` for the engine, and a forced tool
call's output shaped as `tool_calls` (docs/serving.md, "Structured output").

`tool_choice` "auto" (the model chooses between text and a call) is refused with a 400: it
needs a template that renders tools and a parser for the model's own call syntax; "none"
generates text, as without tools.
"""
from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from models.grammar import GrammarError, GrammarSpec, compile_grammar, register_vocabulary


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = Field(None, description="true: no properties beyond the schema's; default false")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]
_server_vocabularies: dict[int, str] = {}     # id(tokenizer) -> its vocabulary key
log = logging.getLogger(__name__)


def vocabulary_of(tokenizer) -> str:
    """The key the server's tokenizer is registered under for grammars (made on first use): its
    directory where it has one, which the pipeline's other processes load it from too."""
    key = _server_vocabularies.get(id(tokenizer))
    if key is None:
        path = getattr(tokenizer, "name_or_path", "")
        key = os.path.abspath(path) if path and os.path.isdir(path) else f"server-tokenizer-{id(tokenizer)}"
        register_vocabulary(key, tokenizer)
        _server_vocabularies[id(tokenizer)] = key
    return key


def preload_server_vocabulary(tokenizer) -> str | None:
    """Register the server's tokenizer for grammars now (`vocabulary_of`), as the server starts:
    xgrammar's import and the vocabulary's table (~0.3 s for the embedded target's on this
    project's CPU) are then not a structured request's wait. The key, or None where the
    tokenizer cannot be taken (a request asking for a grammar then meets the error itself)."""
    try:
        return vocabulary_of(tokenizer)
    except Exception as e:
        log.warning("grammar vocabulary not preloaded: %s: %s", type(e).__name__, e)
        return None


def _error(message: str, param: str) -> GrammarError:
    """A structured-output field at fault (the API answers it with a 400 naming `param`)."""
    return GrammarError(message, param)


def _compiled(spec: GrammarSpec, param: str) -> GrammarSpec:
    """The spec, compiled once now so a bad schema or regex is a 400 naming `param`."""
    try:
        compile_grammar(spec)
    except GrammarError as e:
        raise _error(f"{param}: {e}", param) from None
    return spec


def forced_tool(req) -> list[Tool] | None:
    """The tools a call is forced among (`tool_choice` "required" or named), else None."""
    choice, tools = getattr(req, "tool_choice", None), getattr(req, "tools", None) or []
    if choice is None or choice == "none" or not tools:
        return None
    if choice == "required":
        return tools
    return [t for t in tools if t.function.name == choice.function.name]


def grammar_of(req, tokenizer) -> GrammarSpec | None:
    """The one grammar a request asks for, or None; `GrammarError` naming the field at fault."""
    fmt = getattr(req, "response_format", None)
    if (fmt is None or fmt.type == "text") and req.guided_regex is None and req.guided_choice is None \
            and not getattr(req, "tools", None) and getattr(req, "tool_choice", None) is None:
        return None
    vocabulary = vocabulary_of(tokenizer)
    asked = [name for name, on in (("response_format", fmt is not None and fmt.type != "text"),
                                   ("guided_regex", req.guided_regex is not None),
                                   ("guided_choice", req.guided_choice is not None)) if on]
    tools = _tools_grammar(req, vocabulary)
    if tools is not None:
        asked.append("tool_choice")
    if len(asked) > 1:
        raise _error(f"{' and '.join(asked)} each constrain the output; ask for one", asked[1])
    if tools is not None:
        return tools
    if req.guided_regex is not None:
        return _compiled(GrammarSpec("regex", req.guided_regex, vocabulary), "guided_regex")
    if req.guided_choice is not None:
        return _compiled(GrammarSpec("choice", json.dumps(req.guided_choice), vocabulary), "guided_choice")
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return _compiled(GrammarSpec("json_object", "", vocabulary), "response_format")
    if fmt.json_schema is None:
        raise _error("response_format of type json_schema needs its json_schema", "response_format.json_schema")
    return _compiled(GrammarSpec("json_schema", json.dumps(fmt.json_schema.schema_), vocabulary,
                                 strict=bool(fmt.json_schema.strict)), "response_format.json_schema.schema")


def _tools_grammar(req, vocabulary: str) -> GrammarSpec | None:
    tools, choice = getattr(req, "tools", None), getattr(req, "tool_choice", None)
    if choice is not None and not tools and choice != "none":
        raise _error("tool_choice needs tools", "tool_choice")
    if not tools:
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) < len(names):
        raise _error("tools: two functions share a name", "tools")
    if choice is None or choice == "auto":
        raise _error('tool_choice "auto" (the default with tools) is not supported: ask for "required" '
                     'or a named function, whose arguments are then constrained to its parameters', "tool_choice")
    forced = forced_tool(req)
    if forced is not None and not forced:
        raise _error(f"tool_choice names {choice.function.name!r}, which is not among tools {names}",
                     "tool_choice.function.name")
    if forced is None:
        return None
    if req.stream:
        raise _error("a forced tool call cannot be streamed yet", "stream")
    for i, t in enumerate(forced):       # each schema alone first: the 400 names the tool
        _compiled(GrammarSpec("json_schema", json.dumps(_parameters(t)), vocabulary, strict=bool(t.function.strict)),
                  f"tools[{names.index(t.function.name)}].function.parameters")
    if len(forced) == 1:
        schema = _parameters(forced[0])
    else:                                # which function, and its arguments
        schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                              "arguments": _parameters(t)},
                             "required": ["name", "arguments"], "additionalProperties": False}
                            for t in forced]}
    return _compiled(GrammarSpec("json_schema", json.dumps(schema), vocabulary), "tools")


def _parameters(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}


def tool_call_message(req, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A forced tool call's answer: the assistant message with `tool_calls`, and its finish
    reason ("tool_calls" when the arguments are complete, else the engine's: "length")."""
    forced = forced_tool(req)
    name, arguments = forced[0].function.name, text
    if len(forced) > 1:
        try:
            call = json.loads(text)
            name, arguments = call["name"], json.dumps(call["arguments"], ensure_ascii=False)
        except (ValueError, KeyError, TypeError):     # cut by max_tokens: which one is unknown
            name = ""
    done = finish_reason == "stop"
    message = {"role": "assistant", "content": None,
               "tool_calls": [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": name, "arguments": arguments}}]}
    return message, ("tool_calls" if done else finish_reason)
