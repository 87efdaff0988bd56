package query

import (
	"fmt"
	"strings"
)

// Paused consumer groups. A row (topic, consumer_group) in the outbox's
// paused table stops every claim of that group's rows of that topic, on
// every claim path and in every process, from the next claim on; publishing
// goes on. The table is its own (not a column of the bindings table) so a
// pause needs no binding: a binding would change which groups new messages
// are copied to, and unbinding a group must not silently resume it.

// PausedColumns are the columns of the paused-groups table.
var PausedColumns = []Column{
	{"topic", "text", ""},
	{"consumer_group", "text", ""},
	{"paused_at", "timestamp with time zone", ""},
}

// PausedTable is the unquoted name of the paused-groups table:
// <table>_paused.
func (n Names) PausedTable() string { return derive(n.Table, "_paused") }

// QPaused is the quoted, qualified name of the paused-groups table.
func (n Names) QPaused() string { return n.QSchema + "." + Quote(n.PausedTable()) }

// pausedDDL creates the paused-groups table.
func pausedDDL(n Names) string {
	return fmt.Sprintf(`CREATE TABLE IF NOT EXISTS %s (
    topic          text        NOT NULL,
    consumer_group text        NOT NULL,
    paused_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (topic, consumer_group)
)`, n.QPaused())
}

// NotPaused is the condition every claim statement ANDs to the WHERE of
// each branch that finds rows, for topic $1 and the group in parameter
// group ("$10"): true unless the group is paused. t is Names.QTable.
//
// It refers to parameters only, so the planner makes it an InitPlan (run
// once per statement) and a One-Time Filter above the branch's scan: a
// paused group's claim reads no outbox row and locks none, and its result
// is that of an empty group (no cursor, nothing free), so the subscription
// idles as on an empty queue. TestPauseIsOneTimeFilter pins the shape.
func NotPaused(t, group string) string {
	return fmt.Sprintf(` AND (SELECT NOT EXISTS (SELECT FROM %s p WHERE p.topic = $1 AND p.consumer_group = %s))`, pausedOf(t), group)
}

// pausedOf returns the paused table of the outbox whose QTable is t. Names
// are validated identifiers (no quotes, no dots), so t splits at its dot.
func pausedOf(t string) string {
	schema, table, _ := strings.Cut(t, ".")
	n := Names{QSchema: schema, Table: strings.Trim(table, `"`)}
	return n.QPaused()
}

// Pause pauses group $2 of topic $1 (idempotent: a pause keeps its first
// time).
func Pause(n Names) string {
	return fmt.Sprintf(`INSERT INTO %s (topic, consumer_group) VALUES ($1, $2) ON CONFLICT DO NOTHING`, n.QPaused())
}

// Resume resumes group $2 of topic $1 and, when it was paused, wakes the
// group's idle subscribers at once (NOTIFY $3 with GroupMark topic
// GroupMark group: the payload of rows that became due). It returns whether
// the group was paused.
func Resume(n Names) string {
	return fmt.Sprintf(`WITH del AS (
    DELETE FROM %s WHERE topic = $1 AND consumer_group = $2 RETURNING 1
), woken AS (
    SELECT pg_notify($3, chr(30) || $1 || chr(30) || $2) FROM del
)
SELECT (SELECT count(*) FROM del) > 0, (SELECT count(*) FROM woken)`, n.QPaused())
}

// PausedGroups lists the paused groups, of topic $1 when topic is true:
// (topic, consumer_group, paused_at).
func PausedGroups(n Names, topic bool) string {
	where := ""
	if topic {
		where = " WHERE topic = $1"
	}
	return fmt.Sprintf(`SELECT topic, consumer_group, paused_at FROM %s%s ORDER BY 1, 2`, n.QPaused(), where)
}
