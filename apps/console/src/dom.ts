/** A few DOM helpers: the console builds its pages from plain elements, so that links, buttons
 * and form controls keep the browser's own keyboard behaviour. */
import type { Page } from "@arbor/client";

export type Child = Node | string | number | null | undefined | false | Child[];
type Props = Record<string, unknown>;

/** `h("button", { onclick, class: "primary" }, "Save")`: `on*` are listeners, `class` and
 * known properties are set as properties, anything else as an attribute. */
export function h<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  props: Props | null = null,
  ...children: Child[]
): HTMLElementTagNameMap[K] {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(props ?? {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value as EventListener);
    } else if (key === "class") {
      el.className = String(value);
    } else if (key in el && key !== "list" && key !== "form") {
      (el as unknown as Props)[key] = value;
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  append(el, children);
  return el;
}

export function append(parent: Node, children: Child[]): void {
  for (const child of children.flat(Infinity as 1) as Child[]) {
    if (child === null || child === undefined || child === false) continue;
    parent.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

/** Replaces the element's content. */
export function mount(parent: Element, ...children: Child[]): void {
  parent.replaceChildren();
  append(parent, children);
}

/** The server's name pattern (`Name`, `ProjectId`'s parts, dataset names), as a person reads it. */
const NAME_RULE = "may use letters, digits, '.', '_' and '-' (and is not '.' or '..')";

/** A field as the console's forms label it. */
function fieldName(param: string): string {
  const last =
    param
      .split(/[.[\]]/)
      .filter(Boolean)
      .at(-1) ?? param;
  const words = last.replace(/_id$/, "").replace(/_/g, " ");
  return words.charAt(0).toUpperCase() + words.slice(1);
}

/**
 * What a validator says (`name: must match pattern "^(?!\.\.?$)[A-Za-z0-9._-]+$"`), and what
 * an API client is told to send (`send return_existing: true`), said for a console user.
 */
export function humanMessage(message: string): string {
  const validator = /^(\d{3} )?([\w.[\]]+): (must .*)$/.exec(message);
  if (validator) {
    const [, status = "", param = "", rule = ""] = validator;
    const what = fieldName(param);
    const pattern = /^must match pattern "(.*)"$/.exec(rule)?.[1];
    if (pattern !== undefined) {
      if (!pattern.includes("A-Za-z0-9._-")) return `${status}${what} is not in the expected form.`;
      return pattern.includes("/")
        ? `${status}${what} reads entity/project, and each part ${NAME_RULE}.`
        : `${status}${what} ${NAME_RULE}.`;
    }
    const bound = /^must be (<=|>=|<|>) (.+)$/.exec(rule);
    if (bound) {
      const words = { "<=": "at most", ">=": "at least", "<": "less than", ">": "more than" };
      return `${status}${what} must be ${words[bound[1] as keyof typeof words]} ${bound[2]}.`;
    }
    const length = /^must NOT have (more|fewer) than (\d+) characters$/.exec(rule);
    if (length)
      return `${status}${what} must have ${length[1] === "more" ? "at most" : "at least"} ${length[2]} characters.`;
    if (rule === "must be integer") return `${status}${what} must be a whole number.`;
    return `${status}${what} ${rule}.`;
  }
  // API clients are told how to ask again; the console offers its own action instead.
  return message.replace(/[;.] [Ss]end return_existing: true to get it\.?$/, ".");
}

/** An error as the user should read it: the API's message, with its status when it has one. */
export function errorText(err: unknown): string {
  if (err instanceof Error) {
    const status = (err as { status?: number }).status;
    const message = humanMessage(err.message);
    // API errors read "<status> <message>" already.
    return status && !message.startsWith(`${status} `) ? `${message} (HTTP ${status})` : message;
  }
  return String(err);
}

export function alertBox(err: unknown): HTMLElement {
  return h("div", { class: "alert", role: "alert" }, errorText(err));
}

export function empty(text: string, ...more: Child[]): HTMLElement {
  return h("p", { class: "empty" }, text, ...more);
}

export function time(unixSeconds: number | null | undefined): string {
  if (!unixSeconds) return "—";
  return new Date(unixSeconds * 1000).toLocaleString();
}

export function num(value: number | null | undefined, digits = 4): string {
  if (value === null || value === undefined || Number.isNaN(value)) return "—";
  return Number.isInteger(value) ? value.toLocaleString() : value.toPrecision(digits);
}

/** Asks before a destructive action, with a native modal dialog (focus-trapped, Esc cancels). */
export function confirmAction(question: string, action: string): Promise<boolean> {
  return new Promise((resolve) => {
    const dialog = h(
      "dialog",
      { class: "confirm", "aria-label": action },
      h("p", null, question),
      h(
        "form",
        { method: "dialog", class: "row" },
        h("button", { value: "cancel", autofocus: true }, "Cancel"),
        h("button", { value: "ok", class: "danger" }, action),
      ),
    );
    dialog.addEventListener("close", () => {
      resolve(dialog.returnValue === "ok");
      dialog.remove();
    });
    document.body.append(dialog);
    dialog.showModal();
  });
}

/** A labelled form control. */
export function field(label: string, control: HTMLElement, hint?: string): HTMLElement {
  const id = control.id || `f-${Math.random().toString(36).slice(2)}`;
  control.id = id;
  return h(
    "div",
    { class: "field" },
    h("label", { htmlFor: id }, label),
    control,
    hint ? h("small", null, hint) : null,
  );
}

/** A table: a header row, then one row per item, one cell per child (a `td` given as it is). */
export function table(
  heads: readonly (string | null)[],
  rows: readonly Child[][],
  props: Props | null = null,
): HTMLTableElement {
  return h(
    "table",
    props,
    h(
      "thead",
      null,
      h(
        "tr",
        null,
        heads.map((t) => (t === null ? null : h("th", null, t))),
      ),
    ),
    h(
      "tbody",
      null,
      rows.map((cells) =>
        h(
          "tr",
          null,
          cells.map((cell) => (cell instanceof HTMLTableCellElement ? cell : h("td", null, cell))),
        ),
      ),
    ),
  );
}

/**
 * A list shown page by page: `draw` renders every item read so far into `results`; `more` (a
 * "Load more" button) reads the next page, and is hidden after the last. A failed read is shown
 * under the list and the button stays, to try again. `prepend` shows an item made on the page
 * (an upload) first.
 */
export function pagedList<Item>(
  first: Page<Item>,
  results: Element,
  more: HTMLButtonElement,
  draw: (items: Item[]) => Child,
): { prepend(item: Item): void } {
  let page = first;
  const shown = [...first.data];
  const render = () => {
    mount(results, draw(shown));
    more.hidden = !page.hasNextPage();
  };
  render();
  more.addEventListener("click", async () => {
    more.disabled = true;
    try {
      page = await page.nextPage();
      shown.push(...page.data);
      render();
    } catch (err) {
      results.append(alertBox(err));
    } finally {
      more.disabled = false;
    }
  });
  return {
    prepend(item) {
      shown.unshift(item);
      render();
    },
  };
}
