"""A request's own ``chat_template``: untrusted code, so opt-in and rendered in a separate process.

Off unless ``server.allow_request_chat_template`` (as vLLM's ``--trust-request-chat-template``). When on,
the template renders with transformers' own sandboxed jinja environment (``render_jinja_template``, the
one ``apply_chat_template`` uses) in a process forked from a clean fork server, with a time limit, a memory
limit and a cap on the text's length: a template that loops or grows without end is killed and refused,
while the event loop, and every other request, goes on.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import resource
import time
from multiprocessing.connection import Connection
from typing import Any

from rollout.serve.errors import APIError

TIME_LIMIT_S = 2.0
MAX_CHARS = 4 << 20  # the rendered text; a prompt this long is far past any max_model_len anyway
MEMORY_LIMIT = 1 << 30  # address space the worker may add to what the fork server already maps
_PRELOAD = ["transformers.utils.chat_template_utils"]


def context() -> mp.context.BaseContext:
    """The fork server (started on first use; ``warm`` starts it at server start-up, importing jinja once)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def warm() -> None:
    p = context().Process(target=_noop, daemon=True)
    p.start()
    p.join()


async def render(template: str, messages: list[dict[str, Any]], special_tokens: dict[str, Any],
                 **kwargs: Any) -> str:
    """The template's text for ``messages``; APIError 400 when it fails, runs too long or writes too much."""
    receiver, sender = mp.Pipe(duplex=False)
    proc = context().Process(target=_render, args=(sender, template, messages, special_tokens, kwargs), daemon=True)
    proc.start()
    sender.close()
    deadline = time.monotonic() + TIME_LIMIT_S
    try:
        while not receiver.poll():
            if time.monotonic() > deadline or not proc.is_alive() and not receiver.poll():
                break
            await asyncio.sleep(0.01)
        ok, text = receiver.recv() if receiver.poll() else (False, None)
    except (EOFError, OSError):
        ok, text = False, None
    finally:
        if proc.is_alive():
            proc.kill()
        await asyncio.to_thread(proc.join, 5)
        receiver.close()
    if text is None:
        raise APIError(400, f"the request's chat_template did not finish within {TIME_LIMIT_S:g} s and "
                            f"{MEMORY_LIMIT >> 20} MiB", param="chat_template")
    if not ok:
        raise APIError(400, f"the chat template failed on these messages: {text}", param="messages")
    return text


def _noop() -> None:
    pass


def _render(out: Connection, template: str, messages: list[dict[str, Any]], special_tokens: dict[str, Any],
            kwargs: dict[str, Any]) -> None:
    pages = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * pages
    resource.setrlimit(resource.RLIMIT_AS, (mapped + MEMORY_LIMIT, mapped + MEMORY_LIMIT))
    try:
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[messages], chat_template=template,
                                            **{**special_tokens, **kwargs})
        text = rendered[0]
        if len(text) > MAX_CHARS:
            out.send((False, f"it wrote {len(text)} characters; at most {MAX_CHARS} are allowed"))
        else:
            out.send((True, text))
    except MemoryError:
        out.send((False, f"it needed more than {MEMORY_LIMIT >> 20} MiB"))
    except Exception as e:  # noqa: BLE001 - the template's own error, told to the client
        out.send((False, f"{type(e).__name__}: {str(e)[:500]}"))
    finally:
        out.close()
