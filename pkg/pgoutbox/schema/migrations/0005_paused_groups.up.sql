-- Paused consumer groups: a (topic, consumer_group) row here stops every
-- claim of that group's rows of that topic, in every process; publishing
-- goes on (PauseGroup, ResumeGroup).
CREATE TABLE IF NOT EXISTS {{table "_paused"}} (
    topic          text        NOT NULL,
    consumer_group text        NOT NULL,
    paused_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, consumer_group)
);
