"""Request bodies of the OpenAI-compatible API, and the OpenAI error shape.

Fields localpd does not know are accepted and logged (clients send many); values out of range are 400s.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from localpd.engine.speculate import MAX_DRAFT


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)
    arguments: str = "{}"  # a JSON object, as text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def user_has_content(self):
        if self.role == "user" and self.content is None:
            raise ValueError("a user message needs content")
        return self

    def template_dict(self) -> dict:
        """The message as chat templates take it (tool calls included)."""
        out = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump(exclude_none=True) for c in self.tool_calls]
        out.update({k: v for k in ("tool_call_id", "name") if (v := getattr(self, k)) is not None})
        reasoning = (self.model_extra or {}).get("reasoning_content")
        if isinstance(reasoning, str):  # an earlier reply's reasoning: Qwen3's template reads it
            out["reasoning_content"] = reasoning
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text or "" for p in self.content if p.type == "text")


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs (0.10 on; guided_json, guided_regex, guided_choice and guided_grammar before):
    one of them."""

    model_config = ConfigDict(extra="allow")
    json_: dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark or EBNF (GBNF)


class Sampling(BaseModel):
    """What chat and completion requests share."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=16)  # choices of each prompt: n requests on it, which the prefix cache shares
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    user: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[int, Annotated[float, Field(ge=-100, le=100)]] | None = None  # token id (a string in JSON) -> bias
    stop_token_ids: list[int] | None = None  # vLLM's: tokens that end the reply as end-of-sequence does
    min_tokens: int = Field(0, ge=0)  # vLLM's: end-of-sequence and stop_token_ids held back until this many
    structured_outputs: StructuredOutputs | None = None  # vLLM's: the reply held to a schema, a pattern or choices
    guided_json: dict[str, Any] | None = None  # the same, as vLLM named them before 0.10
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    grammar: str | None = None  # llama.cpp's: a GBNF grammar (Lark taken too)
    # llama.cpp server's: the most tokens drafted for this request a step (speculative decoding; 0: none), at most
    # the server's --draft-tokens
    speculative_n_max: int | None = Field(None, ge=0, le=MAX_DRAFT, alias="speculative.n_max")


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # variables for the model's chat template, as vLLM takes them: {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the last message (the assistant's) is the reply's start, which the model goes on with
    continue_final_message: bool = False
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]  # one prompt, or several (texts or token ids)
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)  # refused above n: localpd does not rank candidates
    suffix: str | None = None  # fill in the middle (a code model's FIM tokens): the reply goes before it


class EmbeddingRequest(BaseModel):
    """POST /v1/embeddings: one input or several, as texts or token ids."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # only the model's own: its vectors are not shortened
    user: str | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize: a prompt, or messages in the chat template."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # the BOS token, where the model's tokenizer adds one
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    tokens: list[int]


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
