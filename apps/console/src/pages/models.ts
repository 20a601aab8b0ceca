import { type Checkpoint, ConflictError, type Model, type TrainingJob } from "@arbor/client";
import { alertBox, confirmAction, empty, field, h, mount, num, table, time } from "../dom.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";

export function modelName(m: Model): string {
  return `${m.entity}/${m.project}/${m.name}`;
}

/** Every item of a paged list, up to `max`. */
export async function all<T>(items: AsyncIterable<T>, max = 1000): Promise<T[]> {
  const out: T[] = [];
  for await (const item of items) {
    out.push(item);
    if (out.length >= max) break;
  }
  return out;
}

/** Base models, then trained models with their latest step and actions. */
export async function modelsPage({ root }: PageContext): Promise<void> {
  const client = api();
  const [entries, trained] = await Promise.all([
    all(client.models.list()),
    all(client.training.models.list()),
  ]);
  const bases = entries.filter((e) => e.parent === null);
  const list = h("div");
  mount(
    root,
    h("h1", null, "Models"),
    h(
      "section",
      { class: "card" },
      h("h2", null, "Trained models"),
      createForm(bases.map((b) => b.id)),
      list,
    ),
    h(
      "section",
      { class: "card" },
      h("h2", null, "Base models"),
      bases.length === 0
        ? empty("This server serves no base model.")
        : table(
            ["Id", "Chat"],
            bases.map((b) => [
              h("code", null, b.id),
              h(
                "a",
                { href: `#/playground?model=${encodeURIComponent(b.id)}` },
                "Open in playground",
              ),
            ]),
          ),
    ),
  );
  renderTrained(list, trained);
}

function renderTrained(list: HTMLElement, trained: Model[]): void {
  if (trained.length === 0) {
    mount(list, empty("No trained models yet: create one above, then train it on a dataset."));
    return;
  }
  mount(
    list,
    table(
      ["Model", "Base", "Latest step", "Created", ""],
      trained.map((m) => [
        h("a", { href: `#/models/${m.id}` }, modelName(m)),
        h("code", null, m.base_model),
        num(m.latest_step),
        time(m.created_at),
        h(
          "td",
          { class: "actions" },
          h(
            "button",
            {
              class: "danger",
              onclick: async (e: Event) => {
                const button = e.currentTarget as HTMLButtonElement;
                if (
                  !(await confirmAction(
                    `Delete ${modelName(m)} with all its checkpoints and files? A running job is cancelled.`,
                    "Delete model",
                  ))
                )
                  return;
                button.disabled = true;
                try {
                  await api().training.models.delete(m.id);
                  renderTrained(
                    list,
                    trained.filter((t) => t.id !== m.id),
                  );
                } catch (err) {
                  button.disabled = false;
                  list.prepend(alertBox(err));
                }
              },
            },
            "Delete",
          ),
        ),
      ]),
    ),
  );
}

function createForm(bases: string[]): HTMLElement {
  const project = h("input", {
    name: "project",
    required: true,
    value: "demo",
    pattern: "[A-Za-z0-9._\\-]+",
  });
  const name = h("input", { name: "name", required: true, pattern: "[A-Za-z0-9._\\-]+" });
  const base = h(
    "select",
    { name: "base_model", required: true },
    bases.map((b) => h("option", { value: b }, b)),
  );
  const status = h("div", { "aria-live": "polite" });
  return h(
    "form",
    {
      class: "row wrap",
      "aria-label": "Create a model",
      onsubmit: async (event: Event) => {
        event.preventDefault();
        mount(status);
        try {
          const model = await api().training.models.create({
            project: project.value,
            name: name.value,
            base_model: base.value,
          });
          location.hash = `#/models/${model.id}`;
        } catch (err) {
          if (!(err instanceof ConflictError)) {
            mount(status, alertBox(err));
            return;
          }
          // The API tells a client to ask again with return_existing; the console does it.
          const wanted = { project: project.value, name: name.value, base_model: base.value };
          mount(
            status,
            h(
              "div",
              { class: "alert", role: "alert" },
              `A model named ${wanted.name} exists in project ${wanted.project} already. `,
              h(
                "button",
                {
                  type: "button",
                  onclick: async () => {
                    try {
                      const model = await api().training.models.create({
                        ...wanted,
                        return_existing: true,
                      });
                      location.hash = `#/models/${model.id}`;
                    } catch (again) {
                      mount(status, alertBox(again));
                    }
                  },
                },
                "Open it",
              ),
            ),
          );
        }
      },
    },
    field("Project", project),
    field("Name", name),
    field("Base model", base),
    h("button", { type: "submit", class: "primary" }, "Create model"),
    status,
  );
}

/** One model: its checkpoints (with metrics, prunable), its jobs, and where to go next. */
export async function modelPage({ root, params }: PageContext): Promise<void> {
  const client = api();
  const id = params[0]!;
  const model = (await all(client.training.models.list())).find((m) => m.id === id);
  if (!model) {
    mount(
      root,
      h("h1", null, "Model"),
      empty("No such model for this key.", " ", h("a", { href: "#/models" }, "All models")),
    );
    return;
  }
  const [checkpoints, jobs] = await Promise.all([
    all(client.training.models.checkpoints.list(id, { order: "desc" })),
    all(client.training.jobs.list({ model_id: id }), 200),
  ]);
  const cpSection = h("section", { class: "card" });
  mount(
    root,
    h("h1", null, modelName(model)),
    h(
      "p",
      { class: "row wrap" },
      h("span", null, "Base ", h("code", null, model.base_model)),
      h("span", null, `Latest step ${num(model.latest_step)}`),
      h(
        "a",
        { href: `#/playground?model=${encodeURIComponent(modelName(model))}` },
        "Chat with the latest checkpoint",
      ),
      h("a", { href: "#/datasets" }, "Train on a dataset"),
    ),
    cpSection,
    h("section", { class: "card" }, h("h2", null, "Training jobs"), jobsTable(jobs)),
  );
  renderCheckpoints(cpSection, model, checkpoints);
}

function renderCheckpoints(section: HTMLElement, model: Model, checkpoints: Checkpoint[]): void {
  const latest = Math.max(...checkpoints.map((c) => c.step));
  const boxes = new Map<number, HTMLInputElement>();
  const status = h("div", { "aria-live": "polite" });
  const prune = h(
    "button",
    {
      class: "danger",
      onclick: async () => {
        const steps = [...boxes].filter(([, b]) => b.checked).map(([s]) => s);
        if (steps.length === 0) {
          mount(status, alertBox(new Error("Select the checkpoints to prune first.")));
          return;
        }
        if (!(await confirmAction(`Delete the checkpoints at steps ${steps.join(", ")}?`, "Prune")))
          return;
        try {
          await api().training.models.checkpoints.delete(model.id, steps);
          renderCheckpoints(
            section,
            model,
            checkpoints.filter((c) => !steps.includes(c.step)),
          );
        } catch (err) {
          mount(status, alertBox(err));
        }
      },
    },
    "Prune selected",
  );
  mount(
    section,
    h("h2", null, "Checkpoints"),
    checkpoints.length === 0
      ? empty("No checkpoints.")
      : table(
          ["", "Step", "Created", "Metrics", ""],
          checkpoints.map((c) => {
            const box = h("input", {
              type: "checkbox",
              "aria-label": `Select step ${c.step}`,
              disabled: c.step === latest,
              title: c.step === latest ? "The latest checkpoint cannot be pruned" : undefined,
            });
            boxes.set(c.step, box);
            const metrics = Object.entries(c.metrics ?? {});
            return [
              box,
              num(c.step),
              time(c.created_at),
              metrics.length === 0
                ? "—"
                : metrics.map(([k, v]) => h("span", { class: "chip" }, `${k} ${num(v as number)}`)),
              h(
                "a",
                {
                  href: `#/playground?model=${encodeURIComponent(`${modelName(model)}:step${c.step}`)}`,
                },
                "Chat",
              ),
            ];
          }),
        ),
    h("div", { class: "row" }, prune),
    status,
  );
}

export function jobsTable(jobs: TrainingJob[], names?: Map<string, string>): HTMLElement {
  if (jobs.length === 0) return empty("No training jobs yet.");
  const t = table(
    ["Job", "Type", names ? "Model" : null, "Status", "Steps", "Created"],
    jobs.map((j) => [
      h("a", { href: `#/jobs/${j.id}` }, h("code", null, j.id.slice(0, 13))),
      j.type.toUpperCase(),
      ...(names
        ? [h("a", { href: `#/models/${j.model_id}` }, names.get(j.model_id) ?? j.model_id)]
        : []),
      h("span", { class: `status ${j.status}` }, j.status),
      `${j.step_from} → ${j.step_to ?? "…"}`,
      time(j.created_at),
    ]),
    { class: "jobs" },
  );
  // On a phone the type and creation time give way, so the rest fits without scrolling sideways.
  const optional = [1, names ? 5 : 4];
  for (const row of t.rows) for (const i of optional) row.cells[i]?.classList.add("wide-only");
  return t;
}
