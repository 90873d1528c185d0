// What the page keeps in the browser: conversations and settings in localStorage (they survive a
// reload and a restart), the API key in sessionStorage only (gone with the tab).

const CONVERSATIONS = "hkserve.conversations";
const CURRENT = "hkserve.current";
const SETTINGS = "hkserve.settings";
const KEY = "hkserve.apiKey";

function read(storage, name, fallback) {
  try {
    return JSON.parse(storage.getItem(name)) ?? fallback;
  } catch {
    return fallback;
  }
}

/** [{id, title, messages: [{role, content, state?, stats?}]}], newest first. */
export const loadConversations = () => read(localStorage, CONVERSATIONS, []);
export const saveConversations = (list) => localStorage.setItem(CONVERSATIONS, JSON.stringify(list));
export const loadCurrent = () => localStorage.getItem(CURRENT);
export const saveCurrent = (id) => localStorage.setItem(CURRENT, id);
export const loadSettings = () => read(localStorage, SETTINGS, {});
export const saveSettings = (values) => localStorage.setItem(SETTINGS, JSON.stringify(values));
export const loadKey = () => sessionStorage.getItem(KEY) || "";
export const saveKey = (key) => sessionStorage.setItem(KEY, key);

export function newConversation() {
  return { id: `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 8)}`, title: "", messages: [] };
}
