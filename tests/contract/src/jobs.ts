import type { ArborClient, TrainingJobEvent } from "@arbor/client";
import pg from "pg";

/** The SFT example the contract tests train on: reversing a short word. */
export function reversal(word: string) {
  return {
    messages: [
      { role: "user" as const, content: `Reverse the word ${word}.` },
      { role: "assistant" as const, content: [...word].reverse().join("") },
    ],
  };
}

/** Those examples as a JSONL dataset, one line per word. */
export function reversalJsonl(words: readonly string[]): string {
  return words.map((word) => JSON.stringify(reversal(word))).join("\n");
}

/** Every event of a job, followed to its terminal one. */
export async function followAll(client: ArborClient, jobId: string): Promise<TrainingJobEvent[]> {
  const events: TrainingJobEvent[] = [];
  for await (const event of client.training.jobs.events.follow(jobId)) events.push(event);
  return events;
}

/** Who holds a job's lease in a PostgreSQL schema (null once it is no one's). */
export async function leaseOwner(
  url: string,
  schema: string,
  jobId: string,
): Promise<string | null> {
  const db = new pg.Client({ connectionString: url });
  await db.connect();
  try {
    const { rows } = await db.query<{ lease_owner: string | null }>(
      `SELECT lease_owner FROM ${schema}.training_jobs WHERE id = $1`,
      [jobId],
    );
    return rows[0]?.lease_owner ?? null;
  } finally {
    await db.end();
  }
}
