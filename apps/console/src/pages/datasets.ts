import type { Dataset, DatasetLine, Model } from "@arbor/client";
import { alertBox, empty, field, h, mount, num, pagedList, table, time } from "../dom.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";
import { all, modelName } from "./models.ts";

/** The datasets uploaded before (newest first, a page at a time; open one to see its lines and
 * train on it); upload a JSONL file (a bad line is shown in place, by number), see what was
 * stored, and start an SFT job on it (a DPO one on preference pairs, ADR 69). */
export async function datasetsPage({ root }: PageContext): Promise<void> {
  const listed = h("div");
  const more = h("button", { type: "button", hidden: true }, "Load more");
  let list: { prepend(dataset: Dataset): void } | undefined;
  const file = h("input", {
    type: "file",
    name: "file",
    accept: ".jsonl,.json,application/jsonl,text/plain",
    required: true,
  });
  const name = h("input", { name: "name", placeholder: "optional" });
  const result = h("div", { "aria-live": "polite" });
  const button = h("button", { type: "submit", class: "primary" }, "Upload");
  mount(
    root,
    h("h1", null, "Datasets"),
    h("section", { class: "card" }, h("h2", null, "Uploaded"), listed, more),
    h(
      "form",
      {
        class: "card",
        "aria-label": "Upload a dataset",
        onsubmit: async (event: Event) => {
          event.preventDefault();
          const chosen = file.files?.[0];
          if (!chosen) return;
          button.disabled = true;
          mount(result, h("p", null, "Uploading and checking every line…"));
          try {
            const dataset = await api().training.datasets.create(chosen, {
              ...(name.value ? { name: name.value } : {}),
            });
            await showDataset(result, dataset);
            list?.prepend(dataset);
          } catch (err) {
            mount(result, await badLine(err, chosen));
          } finally {
            button.disabled = false;
          }
        },
      },
      h("h2", null, "Upload SFT examples"),
      h(
        "p",
        null,
        "One JSON object per line, each with ",
        h("code", null, "messages"),
        " (and optionally ",
        h("code", null, "tools"),
        "), or, for DPO, each a preference pair with ",
        h("code", null, "input"),
        ", ",
        h("code", null, "preferred_output"),
        " and ",
        h("code", null, "non_preferred_output"),
        ". Every line is checked; nothing is stored unless all are valid.",
      ),
      h("div", { class: "row wrap" }, field("JSONL file", file), field("Name", name), button),
    ),
    result,
  );

  list = pagedList(await api().training.datasets.list({ limit: 20 }), listed, more, (shown) =>
    shown.length === 0
      ? empty("No datasets yet: upload a JSONL file below.")
      : table(
          ["Name", "Lines", "Size", "Uploaded", ""],
          shown.map((d) => [
            d.name ?? h("span", { class: "subtle" }, "(no name)"),
            num(d.lines),
            bytes(d.bytes),
            time(d.created_at),
            h(
              "td",
              { class: "actions" },
              h(
                "button",
                {
                  type: "button",
                  "aria-label": `Open ${d.name ?? d.id}`,
                  onclick: async () => {
                    mount(result, h("p", null, "Loading…"));
                    try {
                      await showDataset(result, d);
                      result.scrollIntoView({ block: "start" });
                    } catch (err) {
                      mount(result, alertBox(err));
                    }
                  },
                },
                "Open",
              ),
            ),
          ]),
          { class: "datasets" },
        ),
  );
}

function bytes(n: number): string {
  if (n < 1024) return `${n} B`;
  if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KB`;
  return `${(n / 1024 / 1024).toFixed(1)} MB`;
}

/** The server names the first bad line (`Line 3: …`): show the file around it. */
async function badLine(err: unknown, file: File): Promise<HTMLElement> {
  // The client's message is "<status> <the server's message>".
  const match = /\bLine (\d+):/.exec(err instanceof Error ? err.message : "");
  if (!match) return alertBox(err);
  const number = Number(match[1]);
  const lines = (await file.text()).split(/\r?\n/);
  const from = Math.max(1, number - 2);
  const to = Math.min(lines.length, number + 2);
  const excerpt: HTMLElement[] = [];
  for (let n = from; n <= to; n++) {
    const text = lines[n - 1] ?? "";
    excerpt.push(
      h(
        "div",
        {
          class: n === number ? "line bad" : "line",
          "aria-current": n === number ? "true" : undefined,
        },
        h("span", { class: "lineno" }, String(n)),
        h("code", null, text.length > 300 ? `${text.slice(0, 300)}…` : text || " "),
      ),
    );
  }
  return h("div", { class: "card" }, alertBox(err), h("div", { class: "excerpt" }, excerpt));
}

async function showDataset(result: HTMLElement, dataset: Dataset): Promise<void> {
  const client = api();
  const [page, models, others] = await Promise.all([
    client.training.datasets.lines(dataset.id, { limit: 20 }),
    all(client.training.models.list()),
    all(client.training.datasets.list({ limit: 100 }), 100),
  ]);
  mount(
    result,
    h(
      "section",
      { class: "card" },
      h("h2", null, "Stored"),
      h(
        "dl",
        { class: "grid" },
        h("dt", null, "Id"),
        h("dd", null, h("code", null, dataset.id)),
        h("dt", null, "URL"),
        h("dd", null, h("code", null, dataset.url)),
        h("dt", null, "Lines"),
        h("dd", { "data-lines": String(dataset.lines) }, num(dataset.lines)),
        h("dt", null, "Size"),
        h("dd", null, `${num(dataset.bytes)} bytes`),
      ),
      linesTable(page.data, dataset.lines),
    ),
    // A dataset holds one kind, its first line's: preference pairs train by DPO.
    trainForm(
      dataset,
      models,
      others.filter((d) => d.id !== dataset.id),
      page.data[0] && isPair(page.data[0].example) ? "dpo" : "sft",
    ),
  );
}

type Example = DatasetLine["example"];
type Pair = Extract<Example, { input: unknown }>;
type Message = Pair["input"]["messages"][number];

function isPair(example: Example): example is Pair {
  return "input" in example;
}

function messageLine(m: Message, label: string = m.role): HTMLElement {
  return h(
    "div",
    null,
    h("strong", null, `${label}: `),
    typeof m.content === "string" ? m.content : JSON.stringify(m.content),
  );
}

function linesTable(lines: DatasetLine[], total: number): HTMLElement {
  if (lines.length === 0) return empty("No lines.");
  return h(
    "details",
    { open: true },
    h("summary", null, `First ${lines.length} of ${total} examples`),
    table(
      ["Line", "Messages"],
      lines.map((l) => [
        num(l.line),
        isPair(l.example)
          ? [
              ...l.example.input.messages.map((m) => messageLine(m)),
              ...l.example.preferred_output.map((m) => messageLine(m, "preferred")),
              ...l.example.non_preferred_output.map((m) => messageLine(m, "not preferred")),
            ]
          : l.example.messages.map((m) => messageLine(m)),
      ]),
    ),
  );
}

/** An SFT or DPO job on `dataset`; an SFT one optionally validated on one of `others` (the
 * newest 100). */
function trainForm(
  dataset: Dataset,
  models: Model[],
  others: Dataset[],
  method: "sft" | "dpo",
): HTMLElement {
  const name = method === "dpo" ? "DPO" : "SFT";
  if (models.length === 0)
    return h(
      "section",
      { class: "card" },
      h("h2", null, "Train on it"),
      empty(
        "No trained model to train yet. ",
        h("a", { href: "#/models" }, "Create a model"),
        " first, then upload again.",
      ),
    );
  const model = h(
    "select",
    { name: "model", required: true },
    models.map((m) => h("option", { value: m.id }, modelName(m))),
  );
  const epochs = h("input", { type: "number", name: "epochs", min: 1, max: 100, value: 3 });
  const lr = h("input", {
    type: "number",
    name: "learning_rate",
    min: 0,
    step: "any",
    value: 0.003,
  });
  const batch = h("input", { type: "number", name: "batch_size", min: 1, max: 1024, value: 4 });
  const validation = h(
    "select",
    { name: "validation" },
    h("option", { value: "" }, "None"),
    others.map((d) =>
      h("option", { value: d.url }, `${d.name ?? d.id.slice(0, 13)} (${num(d.lines)} lines)`),
    ),
  );
  const status = h("div", { "aria-live": "polite" });
  return h(
    "form",
    {
      class: "card",
      "aria-label": `Start an ${name} job`,
      onsubmit: async (event: Event) => {
        event.preventDefault();
        mount(status);
        try {
          const job = await api().training.jobs.createSft({
            model_id: model.value,
            training_data_url: dataset.url,
            ...(validation.value ? { validation_data_url: validation.value } : {}),
            config: {
              ...(method === "dpo" ? { method } : {}),
              epochs: Number(epochs.value),
              learning_rate: Number(lr.value),
              batch_size: Number(batch.value),
              lr_schedule: "cosine",
            },
          });
          location.hash = `#/jobs/${job.id}`;
        } catch (err) {
          mount(status, alertBox(err));
        }
      },
    },
    h("h2", null, `Train on it (${name})`),
    h(
      "div",
      { class: "row wrap" },
      field("Model", model),
      field("Epochs", epochs),
      field("Learning rate", lr),
      field("Batch size", batch),
      ...(method === "sft" ? [field("Validation set", validation)] : []),
      h("button", { type: "submit", class: "primary" }, `Start ${name} job`),
    ),
    status,
  );
}
