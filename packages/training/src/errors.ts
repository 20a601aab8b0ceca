import { DomainError, type DomainErrorKind, type DomainErrorOptions } from "@arbor/store";

/** Why training data cannot be had: a bad or refused URL (`invalid`), a file over the cap
 * (`too_large`). Its message fits a job's `error_message`. */
export class TrainingDataError extends DomainError {
  override name = "TrainingDataError";
  constructor(
    kind: Extract<DomainErrorKind, "invalid" | "too_large">,
    message: string,
    options: DomainErrorOptions = {},
  ) {
    super(kind, message, options);
  }
}

/** Input a job cannot train on (a model gone, a checkpoint missing, a plan over the bounds): the
 * job fails with this message. */
export class JobInputError extends DomainError {
  override name = "JobInputError";
  constructor(message: string, options: DomainErrorOptions = {}) {
    super("invalid", message, options);
  }
}
