import { existsSync, mkdirSync } from "node:fs";
import { join, resolve } from "node:path";
import { type Browser, chromium, type Page } from "playwright-core";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { PATIENT } from "../../../vitest.shared.ts";
import { type RunningServer, startServer } from "./harness.ts";
import { RunClient, TrainingRuns } from "./native-runs/client.ts";
import { requestId, reversalBatch, SPEC, sftStep } from "./native-runs/fixtures.ts";

/**
 * The console in a real browser (Debian's chromium, driven by playwright-core) against a live
 * server: sign in, create a model, upload a dataset, start SFT, watch the loss curve grow, chat
 * with the checkpoint. Any console error or failed request on any page fails the test, /docs
 * included. Screenshots go to tests/contract/.screenshots/ (ignored).
 */
const CHROMIUM = process.env.ARBOR_CHROMIUM ?? "/usr/bin/chromium";
const shots = resolve(import.meta.dirname, "../.screenshots");
const missing = !existsSync(CHROMIUM);
if (missing && process.env.CI === "true")
  throw new Error(`${CHROMIUM} is missing: .ci/run installs Debian's chromium for this test.`);

let server: RunningServer;
let browser: Browser;
let page: Page;
/** Everything that went wrong in the page, as it happened. */
const problems: string[] = [];
/** Refusals the test provokes on purpose (`HTTP 401: GET …/path`), each allowed once, with the
 * console's report of them. */
const expected: string[] = [];

function allowOnce(problem: string): void {
  expected.push(problem, "console: Failed to load resource");
}

function report(problem: string): void {
  const i = expected.findIndex((e) => problem.startsWith(e));
  if (i >= 0) expected.splice(i, 1);
  else problems.push(problem);
}

beforeAll(async () => {
  if (missing) return;
  server = await startServer({}, { worker: true });
  browser = await chromium.launch({
    executablePath: CHROMIUM,
    args: ["--no-sandbox", "--disable-dev-shm-usage"],
  });
  page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  page.setDefaultTimeout(PATIENT.timeout);
  page.on("console", (msg) => {
    if (msg.type() === "error") report(`console: ${msg.text()}`);
  });
  page.on("pageerror", (err) => report(`page error: ${err.message}`));
  page.on("requestfailed", (req) =>
    report(`failed: ${req.method()} ${req.url()} (${req.failure()?.errorText})`),
  );
  page.on("response", (res) => {
    if (res.status() >= 400)
      report(`HTTP ${res.status()}: ${res.request().method()} ${new URL(res.url()).pathname}`);
  });
  mkdirSync(shots, { recursive: true });
});

afterAll(async () => {
  await browser?.close();
  await server?.close();
});

async function shot(name: string): Promise<void> {
  await page.screenshot({ path: join(shots, `${name}.png`), fullPage: true });
}

/** The JSONL a user would upload: 48 reversal examples. */
function dataset(): string {
  const words = [
    "cat",
    "dog",
    "sun",
    "map",
    "cup",
    "pen",
    "box",
    "hat",
    "owl",
    "fig",
    "jam",
    "kit",
  ];
  const lines: string[] = [];
  for (let i = 0; i < 48; i++) {
    const w = `${words[i % words.length]}${i % 4}`;
    lines.push(
      JSON.stringify({
        messages: [
          { role: "user", content: `Reverse: ${w}` },
          { role: "assistant", content: [...w].reverse().join("") },
        ],
      }),
    );
  }
  return `${lines.join("\n")}\n`;
}

/** Held-out examples like `dataset()`'s (the same words, other digits): a validation set. */
function heldOut(): string {
  const words = [
    "cat",
    "dog",
    "sun",
    "map",
    "cup",
    "pen",
    "box",
    "hat",
    "owl",
    "fig",
    "jam",
    "kit",
  ];
  return `${words
    .map((word, i) => {
      const w = `${word}${5 + (i % 3)}`;
      return JSON.stringify({
        messages: [
          { role: "user", content: `Reverse: ${w}` },
          { role: "assistant", content: [...w].reverse().join("") },
        ],
      });
    })
    .join("\n")}\n`;
}

/** Drags across a chart's plot from `from` to `to` (fractions of its width), as a user zooms. */
async function dragAcross(figure: ReturnType<Page["locator"]>, from: number, to: number) {
  const box = (await figure.locator(".u-over").boundingBox())!;
  const y = box.y + box.height / 2;
  await page.mouse.move(box.x + box.width * from, y);
  await page.mouse.down();
  await page.mouse.move(box.x + box.width * to, y, { steps: 8 });
  await page.mouse.up();
}

describe.skipIf(missing)("the console in a browser", () => {
  it("when a user signs in, uploads, trains and chats, then every step works with no console error or failed request", async () => {
    const base = server.baseUrl;

    // 1. Sign in.
    await page.goto(`${base}/`);
    await page.waitForURL(/\/console\/#\/signin|\/console\/$/);
    // The hint names where this server wrote its key (it listens on loopback).
    expect(await page.locator("main small").first().textContent()).toContain(
      join(server.dataDir, "admin.key"),
    );
    // A bad key gets a message, not a blank page.
    allowOnce("HTTP 401: GET /v1/preview/models");
    await page.getByLabel("API key").fill("not-a-key");
    await page.getByRole("button", { name: "Sign in", exact: true }).click();
    await page.getByRole("alert").filter({ hasText: "refused this API key" }).waitFor();
    await page.getByLabel("API key").fill(server.adminKey);
    await page.getByRole("button", { name: "Sign in" }).click();
    await page.getByRole("heading", { name: "Models", exact: true }).waitFor();
    expect(await page.evaluate(() => Object.keys(localStorage).length)).toBe(0);
    await shot("models-empty");

    // A model to train.
    await page.getByLabel("Name", { exact: true }).fill("browser");
    await page.getByRole("button", { name: "Create model" }).click();
    await page.getByRole("heading", { name: "default/demo/browser", exact: true }).waitFor();
    await shot("model");
    // The same name again: the console says what exists and offers to open it, where the API
    // tells a client to send return_existing.
    await page.getByRole("link", { name: "Models", exact: true }).click();
    allowOnce("HTTP 409: POST /v1/preview/models");
    await page.getByLabel("Name", { exact: true }).fill("browser");
    await page.getByRole("button", { name: "Create model" }).click();
    const exists = page.getByRole("alert").filter({ hasText: "exists" });
    await exists.waitFor();
    expect(await exists.textContent()).toContain("A model named browser exists in project demo");
    expect(await exists.textContent()).not.toContain("return_existing");
    await exists.getByRole("button", { name: "Open it" }).click();
    await page.getByRole("heading", { name: "default/demo/browser", exact: true }).waitFor();

    // 2. Upload a dataset: first under a name the API refuses, said in words, not a regex.
    await page.getByRole("link", { name: "Datasets", exact: true }).click();
    allowOnce("HTTP 400: POST /v1/preview/datasets");
    await page.getByLabel("JSONL file").setInputFiles({
      name: "answers.jsonl",
      mimeType: "application/jsonl",
      buffer: Buffer.from(dataset()),
    });
    await page.getByLabel("Name", { exact: true }).fill("json answers");
    await page.getByRole("button", { name: "Upload", exact: true }).click();
    const named = page.getByRole("alert").filter({ hasText: "Name" });
    await named.waitFor();
    expect(await named.textContent()).toBe(
      "400 Name may use letters, digits, '.', '_' and '-' (and is not '.' or '..').",
    );
    await page.getByLabel("Name", { exact: true }).fill("");
    // Then one with a bad line, shown in place by its number.
    allowOnce("HTTP 400: POST /v1/preview/datasets");
    const bad = dataset().split("\n");
    bad[2] = '{"messages": "not a list"}';
    await page.getByLabel("JSONL file").setInputFiles({
      name: "bad.jsonl",
      mimeType: "application/jsonl",
      buffer: Buffer.from(bad.join("\n")),
    });
    await page.getByRole("button", { name: "Upload", exact: true }).click();
    const badLine = page.locator(".excerpt .line.bad");
    await badLine.waitFor();
    expect(await badLine.locator(".lineno").textContent()).toBe("3");
    expect(await page.getByRole("alert").first().textContent()).toMatch(/^400 Line 3: /);
    await shot("dataset-error");
    // A held-out set uploaded before (by a script, say), to validate on.
    const api = server.authorizedClient();
    const held = await api.training.datasets.create(heldOut(), { name: "held-out" });
    await page.getByLabel("JSONL file").setInputFiles({
      name: "reversals.jsonl",
      mimeType: "application/jsonl",
      buffer: Buffer.from(dataset()),
    });
    await page.getByRole("button", { name: "Upload" }).click();
    await page.getByRole("heading", { name: "Stored", exact: true }).waitFor();
    expect(await page.locator("[data-lines]").getAttribute("data-lines")).toBe("48");
    await shot("dataset");

    // 3. Start SFT: enough steps to watch it run, validated on the held-out set.
    await page.getByLabel("Epochs").fill("30");
    await page.getByLabel("Batch size").fill("2");
    await page.getByLabel("Validation set").selectOption({ label: "held-out (12 lines)" });
    await page.getByRole("button", { name: "Start SFT job" }).click();
    await page.getByRole("heading", { name: /SFT job/ }).waitFor();
    const firstJob = page.url();
    const firstJobId = new URL(firstJob).hash.split("/")[2]!;
    expect((await api.training.jobs.retrieve(firstJobId)).config).toMatchObject({
      validation_data_url: held.url,
    });

    // 4. The loss curve gains points while the job runs.
    const loss = page.locator('figure[data-metric="Loss"] [data-points]');
    const seen = new Set<number>();
    const deadline = Date.now() + PATIENT.timeout;
    while (Date.now() < deadline) {
      seen.add(Number(await loss.getAttribute("data-points")));
      const status = await page.locator(".status").first().textContent();
      if (status === "succeeded" || status === "failed" || status === "cancelled") break;
      await page.waitForTimeout(100);
    }
    await page.locator(".status", { hasText: "succeeded" }).first().waitFor();
    const final = Number(await loss.getAttribute("data-points"));
    const growing = [...seen].filter((n) => n > 0 && n < final);
    expect(growing.length, `points seen while running: ${[...seen]}`).toBeGreaterThan(0);
    // 48 examples × 30 epochs / batch 2 training points, and the validation curve's: before the
    // first step, every 72 steps (a tenth) and at the last.
    expect(final).toBe(720 + 11);
    expect(await page.locator(".progress").textContent()).toBe("Step 720 / 720");
    // The validation curve is its own series, in the legend, beside the training loss.
    const legend = page.locator('figure[data-metric="Loss"] .u-legend');
    expect(await legend.textContent()).toContain(`SFT ${firstJobId.slice(0, 13)} validation`);
    expect(
      await page.locator('figure[data-metric="Token accuracy"] .u-legend').textContent(),
    ).toContain("validation");
    const validations: { gradient_step: number; loss: number | null }[] = [];
    for await (const e of api.training.jobs.events.list(firstJobId))
      if (e.type === "validation") validations.push(e.data);
    expect(validations.map((v) => v.gradient_step)).toEqual([
      0, 72, 144, 216, 288, 360, 432, 504, 576, 648, 720,
    ]);
    expect(validations.at(-1)!.loss!).toBeLessThan(validations[0]!.loss!);
    const lastValidation = page.locator("dt", { hasText: "Last validation loss" });
    expect(await lastValidation.locator("xpath=following-sibling::dd[1]").textContent()).toBe(
      validations.at(-1)!.loss!.toPrecision(4),
    );
    // Smoothing draws an EMA over the faint raw line; a log scale; both undone.
    await page.getByLabel("Smoothing").fill("0.6");
    await page.locator('figure[data-metric="Loss"][data-smoothing="0.6"]').waitFor();
    expect(await page.locator(".u-legend").first().textContent()).toContain("(smoothed)");
    await page.getByLabel("Log scale").check();
    await page.locator('figure[data-metric="Loss"][data-scale="log"]').waitFor();
    await shot("training-job-smoothed");
    await page.getByLabel("Smoothing").fill("0");
    await page.getByLabel("Log scale").uncheck();
    await page
      .locator('figure[data-metric="Loss"][data-scale="linear"][data-smoothing="0"]')
      .waitFor();
    await shot("training-job");
    // Drag across the loss chart to zoom into those steps; Reset zoom undoes it, and so does a
    // double click.
    const lossChart = page.locator('figure[data-metric="Loss"]');
    const resetZoom = page.getByRole("button", { name: "Reset zoom of Loss" });
    expect(await resetZoom.isVisible()).toBe(false);
    await dragAcross(lossChart, 0.3, 0.6);
    await expect.poll(() => lossChart.getAttribute("data-zoom"), PATIENT).toMatch(/^\d+-\d+$/);
    const [lo, hi] = (await lossChart.getAttribute("data-zoom"))!.split("-").map(Number);
    expect(lo).toBeGreaterThan(0);
    expect(hi).toBeLessThan(720);
    expect(hi! - lo!).toBeLessThan(720 / 2);
    await shot("training-job-zoomed");
    await resetZoom.click();
    await expect.poll(() => lossChart.getAttribute("data-zoom"), PATIENT).toBeNull();
    expect(await resetZoom.isVisible()).toBe(false);
    await dragAcross(lossChart, 0.5, 0.7);
    await expect.poll(() => lossChart.getAttribute("data-zoom"), PATIENT).toMatch(/^\d+-\d+$/);
    await lossChart.locator(".u-over").dblclick();
    await expect.poll(() => lossChart.getAttribute("data-zoom"), PATIENT).toBeNull();

    // 5. Chat with the checkpoint, streamed.
    await page.getByRole("link", { name: /Chat with step/ }).click();
    await page.getByRole("heading", { name: "Playground", exact: true }).waitFor();
    expect(await page.getByLabel("Model", { exact: true }).inputValue()).toMatch(
      /^default\/demo\/browser:step\d+$/,
    );
    await page.getByLabel("Show logprobs").check();
    await page.getByLabel("Message").fill("Reverse: cat0");
    await page.getByRole("button", { name: "Send" }).click();
    await page.locator(".usage").waitFor();
    // The stream is over when Send is enabled again; leaving earlier would abort it.
    await page
      .getByRole("button", { name: "Send", exact: true })
      .and(page.locator(":enabled"))
      .waitFor();
    expect((await page.locator(".answer").textContent())?.length).toBeGreaterThan(0);
    expect(await page.locator("table.logprobs tbody tr").count()).toBeGreaterThan(0);
    await page.getByText(/^Logprobs of \d+ tokens$/).click();
    await page.locator("table.logprobs").waitFor({ state: "visible" });
    await shot("playground");
    // Every setting reaches the request, and shows in the answer: temperature 0 and 2 tokens
    // at most, sent with Ctrl+Enter, in a new chat (one message, not the last chat's three).
    const sent = async (act: () => Promise<void>) => {
      const request = page.waitForRequest(
        (r) => r.method() === "POST" && r.url().endsWith("/v1/chat/completions"),
      );
      await act();
      const body = (await request).postDataJSON() as Record<string, unknown> & {
        messages: unknown[];
      };
      await page
        .getByRole("button", { name: "Send", exact: true })
        .and(page.locator(":enabled"))
        .waitFor();
      return body;
    };
    await page.getByRole("button", { name: "New chat" }).click();
    expect(await page.locator(".transcript .msg").count()).toBe(0);
    await page.getByLabel("Temperature").fill("0");
    await page.getByLabel("Max tokens").fill("2");
    await page.getByLabel("Message").fill("Reverse: dog1");
    const greedy = await sent(() => page.getByLabel("Message").press("Control+Enter"));
    expect(greedy).toMatchObject({
      temperature: 0,
      max_tokens: 2,
      logprobs: true,
      top_logprobs: 3,
      stream: true,
    });
    expect(greedy.messages).toHaveLength(1);
    expect(await page.locator(".usage").last().textContent()).toMatch(
      /^\d+ prompt \+ [12] completion tokens$/,
    );
    expect(await page.locator("table.logprobs").last().locator("tbody tr").count()).toBeLessThan(3);
    const first = await page.locator(".answer").last().textContent();
    // Greedy is greedy: the same question in a new chat gets the same answer.
    await page.getByRole("button", { name: "New chat" }).click();
    await page.getByLabel("Message").fill("Reverse: dog1");
    await sent(() => page.getByRole("button", { name: "Send", exact: true }).click());
    expect(await page.locator(".answer").last().textContent()).toBe(first);
    // Another model (the base model itself), without logprobs.
    await page.getByRole("button", { name: "New chat" }).click();
    await page.getByLabel("Show logprobs").uncheck();
    await page.getByLabel("Model", { exact: true }).fill("arbor/tiny-chat");
    await page.getByLabel("Message").fill("Reverse: dog1");
    const other = await sent(() => page.getByRole("button", { name: "Send", exact: true }).click());
    expect(other).toMatchObject({ model: "arbor/tiny-chat", temperature: 0, max_tokens: 2 });
    expect(other).not.toHaveProperty("logprobs");
    expect(await page.locator(".msg.assistant strong").last().textContent()).toBe(
      "arbor/tiny-chat",
    );
    expect(await page.locator("table.logprobs").count()).toBe(0);
    await shot("playground-settings");

    // A second job, cancelled by the user: a neutral "Cancelled", not a red error; then the
    // first job overlaid on its curves.
    await page.getByRole("link", { name: "Datasets", exact: true }).click();
    await page.getByLabel("JSONL file").setInputFiles({
      name: "reversals.jsonl",
      mimeType: "application/jsonl",
      buffer: Buffer.from(dataset()),
    });
    await page.getByRole("button", { name: "Upload" }).click();
    await page.getByLabel("Epochs").fill("100");
    await page.getByLabel("Batch size").fill("1");
    await page.getByRole("button", { name: "Start SFT job" }).click();
    await page.getByRole("heading", { name: /SFT job/ }).waitFor();
    expect(page.url()).not.toBe(firstJob);
    await page.getByRole("button", { name: "Cancel job" }).click();
    await page.getByRole("dialog").getByRole("button", { name: "Cancel job" }).click();
    await page.locator(".status", { hasText: "cancelled" }).first().waitFor();
    expect(await page.locator(".status").first().textContent()).toBe("cancelled");
    expect(await page.locator(".note").textContent()).toMatch(/^Cancelled\./);
    expect(await page.locator("main [role=alert]").count()).toBe(0);
    // (The page's code is given as text: this package's types have no DOM.)
    const colors = (await page.evaluate(`(() => {
      const danger = document.createElement("span");
      danger.style.color = "var(--danger)";
      document.body.append(danger);
      const out = {
        status: getComputedStyle(document.querySelector(".status")).color,
        danger: getComputedStyle(danger).color,
      };
      danger.remove();
      return out;
    })()`)) as { status: string; danger: string };
    expect(colors.status).not.toBe(colors.danger);
    await shot("job-cancelled");
    const firstId = new URL(firstJob).hash.split("/")[2]!;
    await page.getByLabel("Overlay another job of this model").selectOption(firstId);
    await page.waitForURL(new RegExp(`\\?compare=${firstId}$`));
    // Both jobs' lines, the overlaid one with all its 720 steps.
    await page
      .locator('figure[data-metric="Loss"] .u-legend')
      .filter({ hasText: `SFT ${firstId.slice(0, 13)}` })
      .waitFor();
    await expect
      .poll(
        async () =>
          Number(
            await page
              .locator('figure[data-metric="Loss"] [data-points]')
              .getAttribute("data-points"),
          ),
        PATIENT,
      )
      .toBeGreaterThanOrEqual(720);

    // The datasets uploaded are listed, newest first, 20 at a time: with 20 more uploaded (by a
    // script, say), Load more reads the rest. Open shows one again, ready to train on.
    for (let i = 0; i < 20; i++)
      await api.training.datasets.create(heldOut(), { name: `extra-${i}` });
    await page.getByRole("link", { name: "Datasets", exact: true }).click();
    const uploaded = page.locator("table.datasets tbody tr");
    await uploaded.first().waitFor();
    expect(await uploaded.count()).toBe(20);
    expect(await uploaded.first().locator("td").first().textContent()).toBe("extra-19");
    await page.getByRole("button", { name: "Load more" }).click();
    await expect.poll(() => uploaded.count(), PATIENT).toBe(23);
    expect(await page.getByRole("button", { name: "Load more" }).isVisible()).toBe(false);
    expect(await uploaded.last().locator("td").first().textContent()).toBe("held-out");
    await uploaded
      .filter({ hasText: "(no name)" })
      .first()
      .getByRole("button", { name: /^Open / })
      .click();
    await page.getByRole("heading", { name: "Stored", exact: true }).waitFor();
    expect(await page.locator("[data-lines]").getAttribute("data-lines")).toBe("48");
    await page.getByRole("button", { name: "Start SFT job" }).waitFor();
    await shot("datasets");

    // The other pages load cleanly. Jobs come 20 at a time too: 20 more (queued by a script,
    // and cancelled) make a second page.
    const pager = await api.training.models.create({
      project: "demo",
      name: "pager",
      base_model: "arbor/tiny-chat",
    });
    for (let i = 0; i < 20; i++) {
      const queued = await api.training.jobs.createSft({
        model_id: pager.id,
        training_data_url: held.url,
      });
      await api.training.jobs.cancel(queued.id);
    }
    await page.getByRole("link", { name: "Jobs", exact: true }).click();
    await page.getByRole("heading", { name: "Training jobs", exact: true }).waitFor();
    const jobRows = page.locator("table.jobs tbody tr");
    await jobRows.first().waitFor();
    expect(await jobRows.count()).toBe(20);
    await page.getByRole("button", { name: "Load more" }).click();
    await expect.poll(() => jobRows.count(), PATIENT).toBe(22);
    expect(await page.getByRole("button", { name: "Load more" }).isVisible()).toBe(false);
    await shot("jobs");
    await api.training.models.delete(pager.id);
    await page.getByRole("link", { name: "Usage", exact: true }).click();
    await page.getByRole("heading", { name: "Usage", exact: true }).waitFor();
    await page.locator("table.usage").waitFor();
    // 30 days in weekly bars; the checkpoint chatted with sits under its model (beside the
    // base model the playground also asked); no price: "—".
    expect(await page.locator("figure[data-bucket]").getAttribute("data-bucket")).toBe("week");
    expect((await page.locator("table.usage td.model").allTextContents()).sort()).toEqual([
      "arbor/tiny-chat",
      "default/demo/browser",
    ]);
    expect(await page.locator("table.usage td.checkpoint").first().textContent()).toMatch(
      /^step\d+$/,
    );
    // Show validates the project (its pattern is valid under the v flag) and applies the range.
    await page.getByLabel("Costs").check();
    await page.getByRole("button", { name: "Show", exact: true }).click();
    await page.waitForURL(/#\/usage\?.*costs=1/);
    await page.locator("table.usage th", { hasText: "Cost" }).waitFor();
    expect(
      await page.locator("table.usage tbody tr").first().locator("td").last().textContent(),
    ).toBe("—");
    // A project not in entity/project form is caught in the form, not sent.
    await page.getByLabel("Project").fill("no-slash");
    await page.getByRole("button", { name: "Show", exact: true }).click();
    expect(
      await page.evaluate(`document.querySelector("input[name=project]").validity.patternMismatch`),
    ).toBe(true);
    await shot("usage");

    // On a phone (390 px) the jobs table fits: nothing scrolls sideways.
    await page.setViewportSize({ width: 390, height: 844 });
    await page.goto(`${base}/console/#/jobs`);
    await page.locator("table.jobs tbody tr").first().waitFor();
    const overflow = await page.evaluate(`(() => {
      const t = document.querySelector("table.jobs");
      return {
        page: document.documentElement.scrollWidth - document.documentElement.clientWidth,
        table: t.scrollWidth - t.parentElement.clientWidth,
      };
    })()`);
    expect(overflow).toEqual({ page: 0, table: 0 });
    await shot("jobs-390");
    await page.setViewportSize({ width: 1280, height: 900 });

    // Dark mode reads as well.
    await page.emulateMedia({ colorScheme: "dark" });
    await page.goto(`${base}/console/#/jobs`);
    await page.locator("tbody tr").first().waitFor();
    await shot("jobs-dark");
    await page.emulateMedia({ colorScheme: "light" });

    // The model's own controls: prune its step-0 checkpoint, then delete it; then sign out.
    await page.getByRole("link", { name: "Models", exact: true }).click();
    await page.getByRole("link", { name: "default/demo/browser", exact: true }).click();
    await page.getByRole("heading", { name: "Checkpoints", exact: true }).waitFor();
    const checkpointRows = page
      .locator("section.card", { hasText: "Checkpoints" })
      .locator("tbody tr");
    const before = await checkpointRows.count();
    await page.getByLabel("Select step 0", { exact: true }).check();
    await page.getByRole("button", { name: "Prune selected" }).click();
    await page.getByRole("dialog").getByRole("button", { name: "Prune" }).click();
    await expect.poll(() => checkpointRows.count(), PATIENT).toBe(before - 1);
    await page.getByRole("link", { name: "Models", exact: true }).click();
    await page.getByRole("button", { name: "Delete", exact: true }).click();
    await page.getByRole("dialog").getByRole("button", { name: "Delete model" }).click();
    await page.getByText("No trained models yet").waitFor();
    await page.getByRole("button", { name: "Sign out" }).click();
    await page.getByRole("heading", { name: "Sign in", exact: true }).waitFor();

    expect(problems).toEqual([]);
    expect(expected).toEqual([]);
  });

  it("when a native run trained, then Runs lists it and its page shows each operation with its loss, tokens and learner version, and the loss curve", async () => {
    problems.length = 0;
    // A run as ART drives it: three SFT steps, then closed.
    const runs = new TrainingRuns(server.baseUrl, server.adminKey);
    const run = await RunClient.resolve(runs, {
      requestId: requestId("resolve"),
      spec: SPEC,
      runName: "browser-run",
    });
    const losses: number[] = [];
    for (const word of ["cat", "dog", "sun"])
      losses.push((await sftStep(run, await reversalBatch([word]))).forward.loss.value);
    await run.close();

    // Signed in already after the first case; signed in here when this case runs alone.
    // (#/signin is no route once signed in: the console goes on to #/models.)
    await page.goto(`${server.baseUrl}/console/#/signin`);
    await page
      .getByRole("heading", { name: /^(Models|Sign in)$/ })
      .first()
      .waitFor();
    if (await page.getByLabel("API key").isVisible()) {
      await page.getByLabel("API key").fill(server.adminKey);
      await page.getByRole("button", { name: "Sign in", exact: true }).click();
    }
    await page.getByRole("heading", { name: "Models", exact: true }).waitFor();
    await page.getByRole("link", { name: "Runs", exact: true }).click();
    await page.getByRole("heading", { name: "Training runs", exact: true }).waitFor();
    await page.getByLabel("Status").selectOption("closed");
    await page.waitForURL(/#\/runs\?status=closed$/);
    const row = page.locator("table.runs tbody tr", { hasText: "browser-run" });
    await row.waitFor();
    expect(await row.locator(".status").textContent()).toBe("closed");
    await shot("runs");
    await row.getByRole("link", { name: "browser-run" }).click();
    await page.getByRole("heading", { name: /Training run/ }).waitFor();

    const ops = page.locator("table.operations tbody tr");
    await ops.nth(5).waitFor();
    expect(await ops.count()).toBe(6);
    const cells = async (i: number) => ops.nth(i).locator("td").allTextContents();
    // #, kind, status, loss, tokens, learner version, took.
    const fb = await cells(2);
    expect(fb.slice(0, 3)).toEqual(["2", "forward_backward", "succeeded"]);
    expect(Number(fb[3])).toBeCloseTo(losses[1]!, 2);
    expect(Number(fb[4])).toBeGreaterThan(0);
    expect(fb[5]).toBe("1");
    const step = await cells(5);
    expect([...step.slice(0, 5), step[5]]).toEqual(["5", "optim_step", "succeeded", "—", "—", "3"]);
    const loss = page.locator('figure[data-metric="Loss"] [data-points]');
    expect(await loss.getAttribute("data-points")).toBe("3");
    await page.getByLabel("Smoothing").fill("0.5");
    await page.getByLabel("Log scale").check();
    await page
      .locator('figure[data-metric="Loss"][data-smoothing="0.5"][data-scale="log"]')
      .waitFor();
    expect(await loss.getAttribute("data-points")).toBe("3");
    expect(
      await page.locator('figure[data-metric="Tokens"] [data-points]').getAttribute("data-points"),
    ).toBe("3");
    await shot("run");
    expect(problems).toEqual([]);
  });

  it("when a dataset of preference pairs is uploaded, then its lines show both answers, it starts a DPO job, and the job's page draws DPO's reward curves", async () => {
    problems.length = 0;
    const model = await server.authorizedClient().training.models.create({
      project: "demo",
      name: "browser-dpo",
      base_model: "arbor/tiny-chat",
    });
    const pairs = ["cat", "dog", "sun", "map"].map((w) =>
      JSON.stringify({
        input: { messages: [{ role: "user", content: `Reverse: ${w}` }] },
        preferred_output: [{ role: "assistant", content: [...w].reverse().join("") }],
        non_preferred_output: [{ role: "assistant", content: w }],
      }),
    );
    // Signed in already after the first case; signed in here when this case runs alone.
    await page.goto(`${server.baseUrl}/console/#/signin`);
    await page
      .getByRole("heading", { name: /^(Models|Sign in)$/ })
      .first()
      .waitFor();
    if (await page.getByLabel("API key").isVisible()) {
      await page.getByLabel("API key").fill(server.adminKey);
      await page.getByRole("button", { name: "Sign in", exact: true }).click();
    }
    await page.getByRole("heading", { name: "Models", exact: true }).waitFor();
    await page.getByRole("link", { name: "Datasets", exact: true }).click();
    await page.getByLabel("JSONL file").setInputFiles({
      name: "pairs.jsonl",
      mimeType: "application/jsonl",
      buffer: Buffer.from(pairs.join("\n")),
    });
    await page.getByRole("button", { name: "Upload", exact: true }).click();
    await page.getByRole("heading", { name: "Stored", exact: true }).waitFor();
    expect(await page.locator("[data-lines]").getAttribute("data-lines")).toBe("4");
    const first = await page.locator("details table tbody tr").first().textContent();
    expect(first).toContain("user: Reverse: cat");
    expect(first).toContain("preferred: tac");
    expect(first).toContain("not preferred: cat");
    await page.getByRole("heading", { name: "Train on it (DPO)" }).waitFor();
    await page.getByLabel("Model").selectOption(model.id);
    await page.getByLabel("Epochs").fill("2");
    await page.getByLabel("Batch size").fill("2");
    await page.getByRole("button", { name: "Start DPO job" }).click();
    await page.getByRole("heading", { name: /^DPO job/ }).waitFor();
    await page.locator(".status", { hasText: "succeeded" }).first().waitFor();
    for (const metric of ["Loss", "Reward margin", "Reward accuracy"])
      expect(
        await page
          .locator(`figure[data-metric="${metric}"] [data-points]`)
          .getAttribute("data-points"),
        metric,
      ).toBe("4");
    expect(await page.locator('figure[data-metric="Reward"]').count()).toBe(0);
    await shot("dpo-job");
    expect(problems).toEqual([]);
  });

  it("when /docs is opened, then it loads with no console error and no failed request", async () => {
    problems.length = 0;
    await page.goto(`${server.baseUrl}/docs`, { waitUntil: "networkidle" });
    await page.getByText("Arbor API").first().waitFor();
    await shot("docs");
    // Every link of the page resolves: the ones to its own sections open the page itself.
    const hrefs = await page.$$eval("a[href]", (links) =>
      links.map((a) => (a as unknown as { href: string }).href),
    );
    const own = [...new Set(hrefs)].filter((h) => h.startsWith(server.baseUrl));
    expect(own.length).toBeGreaterThan(3);
    for (const href of own) {
      const res = await page.request.get(href, { headers: { accept: "text/html" } });
      expect(res.status(), href).toBe(200);
    }
    // Reloading a section shows that section, not Redoc's "no page at this address".
    await page.goto(`${server.baseUrl}/training-jobs`, { waitUntil: "networkidle" });
    await page.getByText("Arbor API").first().waitFor();
    expect(new URL(page.url()).pathname).toBe("/training-jobs");
    expect(await page.getByText("No page at this address").count()).toBe(0);
    expect(problems).toEqual([]);
  });
});
