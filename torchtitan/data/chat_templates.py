"""Chat templates: the built-in ones per model family, a tokenizer's own, and the sandbox that renders them.

A template is Jinja source that turns `messages` (dicts with role and content) into text, with special tokens
spelled out. Three are built in, written from each family's published prompt format:

- `llama3`: <|begin_of_text|>, then per message <|start_header_id|>ROLE<|end_header_id|>, a blank line, the content
  (stripped, as Meta's template does) and <|eot_id|>; the generation prompt is the assistant header.
- `chatml` (Qwen2/Qwen3 and others): <|im_start|>ROLE, a newline, the content, <|im_end|> and a newline; no BOS.
- `deepseek_v3`: <｜begin▁of▁sentence｜>, the system messages joined by blank lines, then <｜User｜>CONTENT and
  <｜Assistant｜>CONTENT<｜end▁of▁sentence｜>; the generation prompt is <｜Assistant｜>.

`tokenizer` is the `chat_template` of the tokenizer_config.json (or chat_template.jinja) next to the tokenizer file;
`auto` takes it when present, else the built-in whose special tokens the tokenizer has. A path ending in .jinja is
read as a template. Templates arrive with downloaded models, so all of them are rendered in Jinja's immutable
sandbox (no attribute starting with `_`, no mutation of the inputs): a template that tries is refused with one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

__all__ = ["BUILTIN", "TEMPLATE_CHOICES", "checked_compile", "compile_template", "resolve_template",
           "special_tokens", "tokenizer_config"]

_LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for message in messages -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
    "'<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)
_CHATML = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
# DeepSeek's format puts every system message first, right after BOS and without a header of its own.
_DEEPSEEK_V3 = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + ('\\n\\n' if ns.system else '') + message['content'] -%}"
    "{%- endfor -%}"
    "{{- '<｜begin▁of▁sentence｜>' + ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}{{- '<｜User｜>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)

# name -> (source, the special tokens it needs, the end-of-turn token)
BUILTIN: dict[str, tuple[str, tuple[str, ...], str]] = {
    "llama3": (_LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
               "<|eot_id|>"),
    "chatml": (_CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>"),
    "deepseek_v3": (_DEEPSEEK_V3, ("<｜begin▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"),
                    "<｜end▁of▁sentence｜>"),
}
TEMPLATE_CHOICES = ("auto", "tokenizer", *BUILTIN)


def special_tokens(tokenizer: Any) -> dict[str, tuple[int, bool]]:
    """The tokenizer's added tokens: name -> (id, whether it is special). Template text is split at every one of
    them; an end of turn must be a special one (a plain added token may be ordinary text, such as a whitespace run)."""
    table = getattr(tokenizer, "special_tokens", None)  # TikTokenTokenizer: Llama 3's 256, all special
    if isinstance(table, dict):
        return {name: (int(i), True) for name, i in table.items()}
    backend = getattr(tokenizer, "backend", None)  # Tokenizer: a tokenizers.Tokenizer
    if backend is None:
        return {}
    return {t.content: (int(i), bool(t.special)) for i, t in backend.get_added_tokens_decoder().items()}


def tokenizer_config(tokenizer: Any) -> tuple[dict[str, Any], str | None, Path | None]:
    """(tokenizer_config.json's content, its chat template or None, the file it came from) for the folder of
    `tokenizer.path`; empty where there is none (remote tiktoken files, a bare tokenizer.json)."""
    path = str(getattr(tokenizer, "path", ""))
    if not path or "://" in path:
        return {}, None, None
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    config_path, config = folder / "tokenizer_config.json", {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"model.tokenizer_path: cannot read {config_path}: {e}") from None
        config = config if isinstance(config, dict) else {}
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one is the chat template
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str) and template.strip():
        return config, template, config_path
    jinja_file = folder / "chat_template.jinja"  # where newer transformers versions save it
    if jinja_file.is_file():
        return config, jinja_file.read_text(encoding="utf-8"), jinja_file
    return config, None, None


def resolve_template(tokenizer: Any, choice: str, key: str = "training.chat_template") -> tuple[str, str]:
    """(name for messages, Jinja source) of the template `choice` names, for this tokenizer. A built-in template
    whose special tokens the tokenizer lacks, or no template at all, is a one-line ValueError naming `key`."""
    table = special_tokens(tokenizer)
    if choice.endswith(".jinja"):
        try:
            return choice, Path(choice).expanduser().read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{key}: cannot read {choice}: {e}") from None
    if choice in ("auto", "tokenizer"):
        _, source, where = tokenizer_config(tokenizer)
        if source is not None:
            return f"the chat_template of {where}", source
        if choice == "tokenizer":
            raise ValueError(f"{key}: 'tokenizer', but there is no chat_template in a tokenizer_config.json or "
                             f"chat_template.jinja next to {tokenizer.path}")
        # No template of its own: the family whose header tokens the tokenizer has.
        found = [name for name, (_, needed, _) in BUILTIN.items() if all(t in table for t in needed)]
        if not found:
            raise ValueError(f"{key}: auto found no chat_template next to {tokenizer.path} and none of the special "
                             f"tokens of {', '.join(f'{n} ({BUILTIN[n][1][1]})' for n in BUILTIN)}; name a template "
                             f"(llama3, chatml, deepseek_v3, a .jinja file) and a tokenizer that has its tokens")
        choice = found[0]
    if choice not in BUILTIN:
        raise ValueError(f"{key}: unknown template '{choice}'; one of {', '.join(TEMPLATE_CHOICES)} or a .jinja file")
    source, needed, _ = BUILTIN[choice]
    missing = [t for t in needed if t not in table]
    if missing:
        raise ValueError(f"{key}: the {choice} template needs the special tokens {', '.join(missing)}, which the "
                         f"tokenizer {tokenizer.path} does not have; use that family's tokenizer or another template")
    return choice, source


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want the JSON text as it is.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> Any:
    """The compiled sandboxed template (cached: dataloader workers and prompts compile each source once)."""
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class _Generation(Extension):
        # {% generation %}...{% endgeneration %} marks assistant text in some templates; the body renders as it is
        # (assistant spans are found from the messages' content, torchtitan/data/chat.py).
        tags = {"generation"}

        def parse(self, parser: Any) -> nodes.Node:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    # trim_blocks/lstrip_blocks: the whitespace rules the hub's templates are written for.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def checked_compile(source: str, name: str, key: str) -> Any:
    """compile_template, a syntax error being a one-line ValueError naming `key` and the template."""
    from jinja2.exceptions import TemplateSyntaxError

    try:
        return compile_template(source)
    except TemplateSyntaxError as e:
        raise ValueError(f"{key}: {name} is not a valid Jinja template (line {e.lineno}: {e.message})") from None
