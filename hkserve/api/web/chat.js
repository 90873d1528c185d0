// The OpenAI chat stream as the page reads it: POST /v1/chat/completions with stream: true, server-sent
// events parsed from the fetch body as they arrive. Aborting `signal` closes the connection, and the
// server cancels the request on that disconnect, freeing its slot.

/** An error the server described (OpenAI's error body), shown as its message. */
export class ServerError extends Error {}

async function errorOf(response) {
  try {
    const body = await response.json();
    return new ServerError(body.error?.message || `HTTP ${response.status}`);
  } catch {
    return new ServerError(`HTTP ${response.status} ${response.statusText}`);
  }
}

export function authHeaders(key) {
  return key ? { Authorization: `Bearer ${key}` } : {};
}

/**
 * Streams one chat completion. `onDelta(text)` for each piece of the reply, `onUsage(usage)` for the
 * final usage chunk. Resolves with the finish reason; rejects with ServerError, or AbortError when stopped.
 */
export async function streamChat(body, key, signal, { onDelta, onUsage }) {
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: { "Content-Type": "application/json", ...authHeaders(key) },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorOf(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let finish = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data || data === "[DONE]") continue;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message);
      if (chunk.usage) onUsage(chunk.usage);
      for (const choice of chunk.choices || []) {
        if (choice.delta?.content) onDelta(choice.delta.content);
        if (choice.finish_reason) finish = choice.finish_reason;
      }
    }
  }
  return finish;
}
