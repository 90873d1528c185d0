// Markdown to DOM nodes, for model output. Safety by construction: every piece of model text enters the
// page through createTextNode / textContent, never as HTML, so `<script>` in a reply is just text.
// Covers what chat models write: fenced code blocks, headings, lists, paragraphs, `code`, **bold**, *em*.
// An unclosed fence (a reply still streaming) renders as a code block so far.

const FENCE = /^\s*(```|~~~)\s*([\w+#.-]*)\s*$/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
const INLINE = /(`+)([^`]+?)\1|\*\*([^*\n]+?)\*\*|(?<!\w)__([^_\n]+?)__(?!\w)|\*([^*\s][^*\n]*?)\*|(?<!\w)_([^_\s][^_\n]*?)_(?!\w)/g;

/** The inline pieces of one line of text appended to `parent`. */
function appendInline(parent, text) {
  let last = 0;
  for (const m of text.matchAll(INLINE)) {
    if (m.index > last) parent.appendChild(document.createTextNode(text.slice(last, m.index)));
    const [tag, inner] = m[2] !== undefined ? ["code", m[2]]
      : m[3] !== undefined ? ["strong", m[3]] : m[4] !== undefined ? ["strong", m[4]]
      : ["em", m[5] !== undefined ? m[5] : m[6]];
    const el = document.createElement(tag);
    el.textContent = inner;
    parent.appendChild(el);
    last = m.index + m[0].length;
  }
  if (last < text.length) parent.appendChild(document.createTextNode(text.slice(last)));
}

/** Lines of a paragraph, joined by <br>. */
function paragraph(lines) {
  const p = document.createElement("p");
  lines.forEach((line, i) => {
    if (i) p.appendChild(document.createElement("br"));
    appendInline(p, line);
  });
  return p;
}

/** A code block of `text` (a JSON reply is shown as one), with `codeTools` as in renderMarkdown. */
export function renderCode(lang, text, codeTools) {
  const box = document.createElement("div");
  box.className = "codeblock";
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.textContent = text;
  pre.appendChild(code);
  box.appendChild(pre);
  if (lang) {
    const label = document.createElement("span");
    label.className = "lang";
    label.textContent = lang;
    box.appendChild(label);
  }
  if (codeTools) box.appendChild(codeTools(() => code.textContent));
  return box;
}

/**
 * `text` as a DocumentFragment. `codeTools(getText)`, when given, makes an element (a copy button)
 * placed on each code block.
 */
export function renderMarkdown(text, codeTools) {
  const out = document.createDocumentFragment();
  const lines = text.split("\n");
  let para = [];
  let list = null;
  const flush = () => {
    if (para.length) out.appendChild(paragraph(para));
    para = [];
    list = null;
  };
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    const fence = line.match(FENCE);
    if (fence) {
      flush();
      const body = [];
      for (i++; i < lines.length && !(lines[i].trim() === fence[1]); i++) body.push(lines[i]);
      out.appendChild(renderCode(fence[2], body.join("\n"), codeTools));
      continue;
    }
    const heading = line.match(HEADING);
    const item = line.match(ITEM);
    if (heading) {
      flush();
      const h = document.createElement(`h${Math.min(heading[1].length + 2, 6)}`);
      appendInline(h, heading[2]);
      out.appendChild(h);
    } else if (item) {
      const tag = /\d/.test(item[1]) ? "ol" : "ul";
      if (para.length) flush();
      if (!list || list.tagName.toLowerCase() !== tag) {
        list = document.createElement(tag);
        out.appendChild(list);
      }
      const li = document.createElement("li");
      appendInline(li, item[2]);
      list.appendChild(li);
    } else if (line.trim() === "") {
      flush();
    } else {
      list = null;
      para.push(line);
    }
  }
  flush();
  return out;
}
