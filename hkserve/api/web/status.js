// The corner of the page that says what serves it: the model (GET /v1/models) and the load (GET /metrics,
// Prometheus text: hkserve_requests_running / _waiting and hkserve_slots_total, see hkserve/api/metrics.py).

import { authHeaders } from "./chat.js";

const POLL_MS = 2000;

/** `name value` samples of a Prometheus text exposition (comments and labelled series skipped). */
export function parsePrometheus(text) {
  const out = {};
  for (const line of text.split("\n")) {
    const m = line.match(/^([a-zA-Z_:][\w:]*)\s+(\S+)/);
    if (m) out[m[1]] = Number(m[2]);
  }
  return out;
}

/** The served model's card, or null with the reason shown. */
export async function loadModel(key, show) {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders(key) });
    if (response.status === 401) {
      show("model: enter the API key");
      return null;
    }
    const card = (await response.json()).data[0];
    show(`${card.id} · context ${card.max_model_len}`);
    return card;
  } catch {
    show("model: unreachable");
    return null;
  }
}

/** Polls /metrics for as long as the page is open. */
export function watchMetrics(show) {
  const poll = async () => {
    try {
      const m = parsePrometheus(await (await fetch("/metrics")).text());
      show(`slots ${m.hkserve_requests_running}/${m.hkserve_slots_total} · queue ${m.hkserve_requests_waiting}`);
    } catch {
      show("metrics: unreachable");
    }
    setTimeout(poll, POLL_MS);
  };
  poll();
}
