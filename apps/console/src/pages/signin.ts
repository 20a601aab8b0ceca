import { alertBox, field, h, mount } from "../dom.ts";
import type { PageContext } from "../main.ts";
import { signIn } from "../session.ts";

export async function signInPage({ root }: PageContext): Promise<void> {
  const notice = sessionStorage.getItem("arbor.console.notice");
  sessionStorage.removeItem("arbor.console.notice");
  const key = h("input", {
    type: "password",
    name: "apiKey",
    autocomplete: "off",
    required: true,
    autofocus: true,
  });
  const status = h("div", { "aria-live": "polite" });
  const form = h(
    "form",
    {
      class: "card narrow",
      onsubmit: async (event: Event) => {
        event.preventDefault();
        button.disabled = true;
        mount(status);
        try {
          await signIn(key.value.trim());
          location.hash = "#/models";
        } catch (err) {
          const refused = (err as { status?: number }).status === 401;
          mount(
            status,
            alertBox(refused ? new Error("The server refused this API key (HTTP 401).") : err),
          );
          key.focus();
        } finally {
          button.disabled = false;
        }
      },
    },
    h("h1", null, "Sign in"),
    h(
      "p",
      null,
      "Use an API key of this server. The console keeps it in this tab's session storage only.",
    ),
    notice ? alertBox(new Error(notice)) : null,
    field("API key", key, await keyHint()),
    status,
  );
  const button = h("button", { type: "submit", class: "primary" }, "Sign in");
  form.append(button);
  mount(root, form);
}

/** Where the first start wrote its key: the server names the file when only this machine can
 * reach it (it listens on loopback); otherwise where to look for it. */
async function keyHint(): Promise<string> {
  try {
    const res = await fetch("/console/hints.json");
    const hints = (await res.json()) as { admin_key_path?: string | null };
    if (res.ok && hints.admin_key_path)
      return `The first start prints one and writes it to ${hints.admin_key_path}.`;
  } catch {
    // An older server: the general hint below.
  }
  return "The first start prints one and writes it to admin.key in the server's data directory (ARBOR_DATA_DIR, ~/.arbor by default).";
}
