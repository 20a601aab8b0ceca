import type { ChatCompletionChunk, ChatCompletionCreateParamsStreaming } from "@arbor/client";
import { alertBox, field, h, mount, num, table } from "../dom.ts";
import type { PageContext } from "../main.ts";
import { api } from "../session.ts";
import { all } from "./models.ts";

type Message = ChatCompletionCreateParamsStreaming["messages"][number];
type TokenLogprob = NonNullable<
  NonNullable<ChatCompletionChunk["choices"][number]["logprobs"]>["content"]
>[number];

/** A streaming chat with any base model, trained model or `:stepN` checkpoint. */
export async function playgroundPage({ root, query, signal }: PageContext): Promise<void> {
  const entries = await all(api().models.list({ include: "checkpoints" }));
  const model = h("input", {
    name: "model",
    list: "model-ids",
    required: true,
    value: query.get("model") ?? entries.find((e) => e.parent === null)?.id ?? "",
    size: 40,
  });
  const ids = h(
    "datalist",
    { id: "model-ids" },
    entries.map((e) => h("option", { value: e.id })),
  );
  const temperature = h("input", {
    type: "number",
    name: "temperature",
    min: 0,
    max: 2,
    step: 0.1,
    value: 0.7,
  });
  const maxTokens = h("input", {
    type: "number",
    name: "max_tokens",
    min: 1,
    max: 4096,
    value: 64,
  });
  const logprobs = h("input", { type: "checkbox", name: "logprobs" });
  const prompt = h("textarea", {
    name: "prompt",
    rows: 3,
    required: true,
    placeholder: "Ask something…",
  });
  const transcript = h("div", { class: "transcript", "aria-live": "polite" });
  const send = h("button", { type: "submit", class: "primary" }, "Send");
  const clear = h("button", { type: "button" }, "New chat");
  const history: Message[] = [];

  clear.addEventListener("click", () => {
    history.length = 0;
    mount(transcript);
    prompt.focus();
  });
  prompt.addEventListener("keydown", (e: KeyboardEvent) => {
    if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) form.requestSubmit();
  });

  const form = h(
    "form",
    {
      class: "card",
      "aria-label": "Chat",
      onsubmit: async (event: Event) => {
        event.preventDefault();
        const content = prompt.value.trim();
        if (!content) return;
        history.push({ role: "user", content });
        transcript.append(
          h("div", { class: "msg user" }, h("strong", null, "You"), h("p", null, content)),
        );
        prompt.value = "";
        const answer = h("p", { class: "answer" });
        const meta = h("div", { class: "meta" });
        transcript.append(
          h("div", { class: "msg assistant" }, h("strong", null, model.value), answer, meta),
        );
        send.disabled = true;
        const tokens: TokenLogprob[] = [];
        let text = "";
        try {
          const stream = await api().chat.completions.create(
            {
              model: model.value.trim(),
              messages: history,
              temperature: Number(temperature.value),
              max_tokens: Number(maxTokens.value),
              stream: true,
              stream_options: { include_usage: true },
              ...(logprobs.checked ? { logprobs: true, top_logprobs: 3 } : {}),
            },
            { signal },
          );
          for await (const chunk of stream) {
            const choice = chunk.choices[0];
            if (choice?.delta.content) {
              text += choice.delta.content;
              answer.textContent = text;
            }
            tokens.push(...(choice?.logprobs?.content ?? []));
            if (chunk.usage) {
              mount(
                meta,
                h(
                  "span",
                  { class: "usage" },
                  `${num(chunk.usage.prompt_tokens)} prompt + ${num(chunk.usage.completion_tokens)} completion tokens`,
                ),
              );
            }
          }
          history.push({ role: "assistant", content: text });
          if (tokens.length) meta.append(logprobTable(tokens));
        } catch (err) {
          if (!signal.aborted) meta.append(alertBox(err));
          history.pop();
        } finally {
          send.disabled = false;
          prompt.focus();
        }
      },
    },
    h(
      "div",
      { class: "row wrap" },
      field("Model", model, "A base model, a trained model, or one of its :stepN checkpoints"),
      ids,
      field("Temperature", temperature),
      field("Max tokens", maxTokens),
      h("label", { class: "check" }, logprobs, " Show logprobs"),
    ),
    transcript,
    field("Message", prompt, "Ctrl+Enter sends"),
    h("div", { class: "row" }, send, clear),
  );
  mount(root, h("h1", null, "Playground"), form);
}

function logprobTable(tokens: TokenLogprob[]): HTMLElement {
  return h(
    "details",
    null,
    h("summary", null, `Logprobs of ${tokens.length} tokens`),
    table(
      ["Token", "Logprob", "Alternatives"],
      tokens.map((t) => [
        h("code", null, JSON.stringify(t.token)),
        num(t.logprob, 3),
        (t.top_logprobs ?? [])
          .map((a) => `${JSON.stringify(a.token)} ${num(a.logprob, 3)}`)
          .join(", "),
      ]),
      { class: "logprobs" },
    ),
  );
}
