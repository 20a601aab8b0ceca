import type { TrainingJob, TrainingJobEvent } from "@arbor/client";
import { chartControls, type Line, MetricChart } from "../chart.ts";
import { alertBox, confirmAction, field, h, mount, num, pagedList, time } from "../dom.ts";
import { eta } from "../format.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";
import { all, jobsTable, modelName } from "./models.ts";

const STATUSES = ["", "queued", "running", "succeeded", "failed", "cancelled"] as const;

/** A project's jobs, newest first, filtered by project and status, a page at a time. */
export async function jobsPage({ root, query }: PageContext): Promise<void> {
  const client = api();
  const models = await all(client.training.models.list());
  const names = new Map(models.map((m) => [m.id, modelName(m)]));
  const projects = [...new Set(models.map((m) => m.project))].sort();
  const project = h(
    "select",
    { name: "project" },
    h("option", { value: "" }, "All projects"),
    projects.map((p) => h("option", { value: p, selected: query.get("project") === p }, p)),
  );
  const status = h(
    "select",
    { name: "status" },
    STATUSES.map((s) =>
      h("option", { value: s, selected: (query.get("status") ?? "") === s }, s || "Any status"),
    ),
  );
  const results = h("div");
  const more = h("button", { hidden: true }, "Load more");
  const filter = () => {
    const q = new URLSearchParams();
    if (project.value) q.set("project", project.value);
    if (status.value) q.set("status", status.value);
    location.hash = `#/jobs${q.size ? `?${q}` : ""}`;
  };
  project.addEventListener("change", filter);
  status.addEventListener("change", filter);
  mount(
    root,
    h("h1", null, "Training jobs"),
    h("div", { class: "row wrap" }, field("Project", project), field("Status", status)),
    h("section", { class: "card" }, results, more),
  );

  const page = await client.training.jobs.list({
    limit: 20,
    ...(query.get("project") ? { project: query.get("project")! } : {}),
    ...(query.get("status") ? { status: query.get("status") as TrainingJob["status"] } : {}),
  });
  pagedList(page, results, more, (shown) => jobsTable(shown, names));
}

/** What a job trains by: RL, SFT, or DPO (an SFT job's `config.method`, ADR 69). */
type Kind = "rl" | "sft" | "dpo";

function kindOf(job: TrainingJob): Kind {
  const method = (job.config as { config?: { method?: string } } | null)?.config?.method;
  return job.type === "rl" ? "rl" : method === "dpo" ? "dpo" : "sft";
}

/** The metrics of `gradient_step` events, each drawn over the job's steps; some only for the
 * jobs of one kind. */
const METRICS: [key: string, title: string, only: Kind | null][] = [
  ["loss", "Loss", null],
  ["mean_token_accuracy", "Token accuracy", "sft"],
  ["reward", "Reward", "rl"],
  ["reward_margin", "Reward margin", "dpo"],
  ["reward_accuracy", "Reward accuracy", "dpo"],
  ["grad_norm", "Gradient norm", null],
  ["learning_rate", "Learning rate", null],
  ["tokens_per_second", "Tokens / s", null],
];

/** The metrics a `validation` event also has: drawn beside the training curve of that name. */
const VALIDATED = ["loss", "mean_token_accuracy"] as const;

interface Followed {
  job: TrainingJob;
  lines: Map<string, Line>;
  /** The validation curves (jobs with a validation set), by metric. */
  validation: Map<string, Line>;
}

/** Whether a job evaluates a validation set (its settings, as created, name one). */
function validates(job: TrainingJob): boolean {
  return typeof (job.config as { validation_data_url?: unknown }).validation_data_url === "string";
}

/** A job: status, settings, error, and its curves, live while it runs; another job of the same
 * model can be overlaid (`?compare=<job id>`). */
export async function jobPage({ root, params, query, signal }: PageContext): Promise<void> {
  const client = api();
  const job = await client.training.jobs.retrieve(params[0]!);
  const compareId = query.get("compare");
  const [siblings, compared, models] = await Promise.all([
    all(client.training.jobs.list({ model_id: job.model_id }), 200),
    compareId ? client.training.jobs.retrieve(compareId) : Promise.resolve(null),
    all(client.training.models.list()),
  ]);
  const model = models.find((m) => m.id === job.model_id);
  const followed: Followed[] = [job, ...(compared ? [compared] : [])].map((j) => {
    const label = `${kindOf(j).toUpperCase()} ${j.id.slice(0, 13)}`;
    return {
      job: j,
      lines: new Map(METRICS.map(([key]) => [key, { label, values: new Map(), marks: new Set() }])),
      validation: new Map(
        validates(j)
          ? VALIDATED.map((key) => [
              key,
              { label: `${label} validation`, values: new Map(), validation: true },
            ])
          : [],
      ),
    };
  });
  const kinds = new Set(followed.map((f) => kindOf(f.job)));
  const charts = METRICS.filter(([, , only]) => only === null || kinds.has(only)).map(
    ([key, title]) =>
      new MetricChart(
        title,
        followed.flatMap((f) => [
          f.lines.get(key)!,
          ...(f.validation.has(key) ? [f.validation.get(key)!] : []),
        ]),
      ),
  );
  signal.addEventListener("abort", () => {
    for (const c of charts) c.destroy();
  });

  const summary = h("section", { class: "card", "aria-live": "polite" });
  const compare = h(
    "select",
    { name: "compare" },
    h("option", { value: "" }, "None"),
    siblings
      .filter((s) => s.id !== job.id)
      .map((s) =>
        h(
          "option",
          { value: s.id, selected: s.id === compareId },
          `${kindOf(s).toUpperCase()} ${s.id.slice(0, 13)} (${s.status}, ${time(s.created_at)})`,
        ),
      ),
  );
  compare.addEventListener("change", () => {
    location.hash = `#/jobs/${job.id}${compare.value ? `?compare=${compare.value}` : ""}`;
  });
  mount(
    root,
    h("h1", null, `${kindOf(job).toUpperCase()} job`, " ", h("code", { class: "subtle" }, job.id)),
    summary,
    h(
      "section",
      { class: "card" },
      h(
        "div",
        { class: "row wrap" },
        h("h2", null, "Curves"),
        h("span", { class: "spacer" }),
        field("Overlay another job of this model", compare),
      ),
      chartControls(charts),
      h(
        "div",
        { class: "charts" },
        charts.map((c) => c.element),
      ),
    ),
  );

  // Many events can arrive at once (a finished job's whole history): draw once per frame.
  let drawing = false;
  const redraw = () => {
    if (drawing) return;
    drawing = true;
    requestAnimationFrame(() => {
      drawing = false;
      for (const c of charts) c.update();
    });
  };

  const latest = new Map<string, number>();
  /** Where the job went on after its worker died, one entry per resumed run. */
  const resumes: string[] = [];
  const progress: Progress = {
    step: job.progress?.step ?? null,
    total: job.progress?.total_steps ?? null,
    anchor: null,
    last: null,
  };
  /** The job as last known: an ended one stays ended while the rest of its events arrive (a
   * cancelled job's worker reports the step it was in). */
  let current = job;
  const drawSummary = (next: TrainingJob) => {
    const ended = current.status !== "queued" && current.status !== "running";
    if (ended && (next.status === "queued" || next.status === "running")) return;
    current = next;
    mount(
      summary,
      jobSummary(
        current,
        model ? modelName(model) : current.model_id,
        latest,
        resumes,
        progress,
        drawSummary,
      ),
    );
  };
  drawSummary(job);

  await Promise.all(
    followed.map(async (f, i) => {
      try {
        for await (const event of client.training.jobs.events.follow(
          f.job.id,
          {},
          { signal, timeout: 24 * 3600_000 },
        )) {
          apply(f, event);
          redraw();
          if (i === 0) {
            const data = event.data as Record<string, unknown>;
            if (event.type === "validation" && typeof data.loss === "number")
              latest.set("validation_loss", data.loss);
            if (event.type === "gradient_step") {
              for (const [k, v] of Object.entries(data))
                if (typeof v === "number") latest.set(k, v);
              const step = Number(data.gradient_step);
              progress.step = step;
              progress.last = { step, at: event.created_at };
              progress.anchor ??= { step, at: event.created_at };
              drawSummary({ ...current, status: "running" });
            }
            if (event.type === "training_started") {
              // Each run (a resumed one too) plans its steps; the rate is measured from here.
              if (typeof data.num_sequences === "number") progress.total = data.num_sequences;
              progress.anchor = null;
            }
            if (event.type === "training_started" && typeof data.resumed_from_step === "number") {
              resumes.push(
                `from step ${data.resumed_from_step}${typeof data.attempt === "number" ? ` (attempt ${data.attempt})` : ""}`,
              );
              drawSummary({ ...current, status: "running" });
            }
            if (event.type === "training_ended" || event.type === "training_failed")
              drawSummary(await client.training.jobs.retrieve(job.id));
          }
        }
      } catch (err) {
        if (!signal.aborted) summary.append(alertBox(err));
      }
    }),
  );
}

function apply(f: Followed, event: TrainingJobEvent): void {
  const data = event.data as Record<string, unknown>;
  if (event.type === "gradient_step") {
    // One point per step: a step is reported once (a resumed run does not report again the
    // steps it re-trains), and in a history from before that, the first report stands.
    const step = Number(data.gradient_step);
    for (const [key] of METRICS) {
      const v = data[key];
      const values = f.lines.get(key)!.values;
      if (typeof v === "number" && Number.isFinite(v) && !values.has(step)) values.set(step, v);
    }
  } else if (event.type === "validation") {
    // Step 0 is the adapter before training: the curve's start.
    const step = Number(data.gradient_step);
    for (const [key, line] of f.validation) {
      const v = data[key];
      if (typeof v === "number" && Number.isFinite(v) && !line.values.has(step))
        line.values.set(step, v);
    }
  } else if (event.type === "checkpoint_saved") {
    // Checkpoint steps count from the model's first step; the curves from the job's.
    const step = Number(data.step) - f.job.step_from;
    for (const line of f.lines.values()) line.marks!.add(step);
  }
}

/** How far a job got, and from which two of its steps its pace is measured. */
interface Progress {
  step: number | null;
  total: number | null;
  anchor: { step: number; at: number } | null;
  last: { step: number; at: number } | null;
}

/** `Step 171 / 600 · about 7 min left`. */
function progressText(job: TrainingJob, p: Progress): string {
  if (p.step === null) return job.status === "queued" ? "Not started" : "—";
  const of = p.total !== null ? `Step ${num(p.step)} / ${num(p.total)}` : `Step ${num(p.step)}`;
  if (job.status !== "running" || p.total === null || !p.anchor || !p.last) return of;
  const left = eta(p.last.step - p.anchor.step, p.last.at - p.anchor.at, p.total - p.last.step);
  return left ? `${of} · ${left}` : of;
}

function jobSummary(
  job: TrainingJob,
  model: string,
  latest: Map<string, number>,
  resumes: readonly string[],
  progress: Progress,
  changed: (job: TrainingJob) => void,
): HTMLElement {
  const running = job.status === "queued" || job.status === "running";
  // The user's own cancel is a decision, not a failure: no red alert for it.
  const cancelled = job.status === "cancelled";
  const rows: [string, Node | string][] = [
    ["Status", h("span", { class: `status ${job.status}` }, job.status)],
    ["Progress", h("span", { class: "progress" }, progressText(job, progress))],
    ["Model", h("a", { href: `#/models/${job.model_id}` }, model)],
    ["Created", time(job.created_at)],
    ["Started", time(job.training_start)],
    ["Ended", time(job.training_end)],
    ["Model steps", `${job.step_from} → ${job.step_to ?? "…"}`],
    ...(resumes.length > 0 ? [["Resumed", resumes.join(", ")] as [string, string]] : []),
    ...["loss", "validation_loss", "reward", "gradient_step"]
      .filter((k) => latest.has(k))
      .map((k) => [`Last ${k.replace("_", " ")}`, num(latest.get(k))] as [string, string]),
  ];
  return h(
    "div",
    null,
    h(
      "dl",
      { class: "grid" },
      rows.map(([k, v]) => [h("dt", null, k), h("dd", null, v)]),
    ),
    cancelled
      ? h(
          "p",
          { class: "note" },
          "Cancelled. The checkpoints it saved stay; a new job can go on from the latest.",
        )
      : job.error_message
        ? h("div", { class: "alert", role: "alert" }, `Error: ${job.error_message}`)
        : null,
    h(
      "details",
      null,
      h("summary", null, "Settings"),
      h("pre", null, JSON.stringify(job.config ?? {}, null, 2)),
    ),
    h(
      "div",
      { class: "row" },
      running
        ? h(
            "button",
            {
              class: "danger",
              onclick: async (e: Event) => {
                // `currentTarget` is null once the event's dispatch is over: read it first.
                const button = e.currentTarget as HTMLButtonElement;
                if (
                  !(await confirmAction(
                    "Cancel this job? Its last checkpoint stays.",
                    "Cancel job",
                  ))
                )
                  return;
                button.disabled = true;
                try {
                  changed(await api().training.jobs.cancel(job.id));
                } catch (err) {
                  button.disabled = false;
                  button.after(alertBox(err));
                }
              },
            },
            "Cancel job",
          )
        : null,
      job.step_to !== null
        ? h(
            "a",
            {
              class: "button",
              href: `#/playground?model=${encodeURIComponent(`${model}:step${job.step_to}`)}`,
            },
            `Chat with step ${job.step_to}`,
          )
        : null,
    ),
  );
}
