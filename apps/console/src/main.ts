import "uplot/dist/uPlot.min.css";
import "./style.css";
import { AuthenticationError, PermissionDeniedError } from "@arbor/client";
import { alertBox, h, mount } from "./dom.ts";
import { datasetsPage } from "./pages/datasets.ts";
import { jobPage, jobsPage } from "./pages/jobs.ts";
import { modelPage, modelsPage } from "./pages/models.ts";
import { playgroundPage } from "./pages/playground.ts";
import { runPage, runsPage } from "./pages/runs.ts";
import { signInPage } from "./pages/signin.ts";
import { usagePage } from "./pages/usage.ts";
import { apiKey, signOut } from "./session.ts";

/** What a page gets: where to draw, a signal aborted when the user leaves it, the route's
 * parameters and query. */
export interface PageContext {
  root: HTMLElement;
  signal: AbortSignal;
  params: string[];
  query: URLSearchParams;
}
type Page = (ctx: PageContext) => Promise<void>;

const NAV: [string, string][] = [
  ["#/models", "Models"],
  ["#/jobs", "Jobs"],
  ["#/runs", "Runs"],
  ["#/datasets", "Datasets"],
  ["#/playground", "Playground"],
  ["#/usage", "Usage"],
];

const ROUTES: [RegExp, Page, string][] = [
  [/^\/models$/, modelsPage, "Models"],
  [/^\/models\/([^/]+)$/, modelPage, "Model"],
  [/^\/jobs$/, jobsPage, "Jobs"],
  [/^\/jobs\/([^/]+)$/, jobPage, "Training job"],
  [/^\/runs$/, runsPage, "Training runs"],
  [/^\/runs\/([^/]+)$/, runPage, "Training run"],
  [/^\/datasets$/, datasetsPage, "Datasets"],
  [/^\/playground$/, playgroundPage, "Playground"],
  [/^\/usage$/, usagePage, "Usage"],
];

const app = document.getElementById("app")!;
let leaving: AbortController | undefined;

async function render(): Promise<void> {
  leaving?.abort();
  const controller = new AbortController();
  leaving = controller;
  const [path = "/", search = ""] = location.hash.replace(/^#/, "").split("?", 2);
  const main = h("main", { id: "main", tabindex: -1 });

  if (!apiKey()) {
    mount(app, header(false), main);
    document.title = "Sign in · Arbor";
    await signInPage({
      root: main,
      signal: controller.signal,
      params: [],
      query: new URLSearchParams(search),
    });
    return;
  }
  const route = ROUTES.find(([re]) => re.test(path));
  if (!route) {
    location.replace("#/models");
    return;
  }
  const [re, page, title] = route;
  const params = (re.exec(path) ?? []).slice(1).map(decodeURIComponent);
  mount(app, header(true, path), main);
  document.title = `${title} · Arbor`;
  try {
    await page({
      root: main,
      signal: controller.signal,
      params,
      query: new URLSearchParams(search),
    });
  } catch (err) {
    if (controller.signal.aborted) return;
    if (err instanceof AuthenticationError) {
      signOut();
      sessionStorage.setItem(
        "arbor.console.notice",
        "The server refused the API key. Sign in again.",
      );
      location.hash = "#/signin";
      return;
    }
    main.append(
      alertBox(
        err instanceof PermissionDeniedError
          ? new Error(`This key may not do that: ${err.message}`)
          : err,
      ),
    );
  }
}

function header(signedIn: boolean, path = ""): HTMLElement {
  return h(
    "header",
    { class: "top" },
    h("a", { class: "brand", href: "#/models" }, "Arbor"),
    signedIn
      ? h(
          "nav",
          { "aria-label": "Main" },
          NAV.map(([href, label]) =>
            h(
              "a",
              { href, "aria-current": path.startsWith(href.slice(1)) ? "page" : undefined },
              label,
            ),
          ),
        )
      : null,
    h("span", { class: "spacer" }),
    h("a", { href: "/docs", class: "subtle" }, "API docs"),
    signedIn
      ? h(
          "button",
          {
            class: "subtle",
            onclick: () => {
              signOut();
              location.hash = "#/signin";
              void render();
            },
          },
          "Sign out",
        )
      : null,
  );
}

// The skip link focuses the content; it is not a route.
document.querySelector("a.skip")?.addEventListener("click", (event) => {
  event.preventDefault();
  document.getElementById("main")?.focus();
});
window.addEventListener("hashchange", () => void render());
void render();
