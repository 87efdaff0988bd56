package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/dbclock"
	"github.com/pgoutbox/watermill-pgoutbox/internal/olderthan"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

const dlqUsage = `Usage:
  pgoutbox dlq list [--topic T] [--group G] [--reason R] [--since T] [--until T] [--after ID] [--limit N] [--json]
  pgoutbox dlq show ID [--json]
  pgoutbox dlq requeue (--id N ... | --topic T --group G --reason R | --all) [--no-dlq] [--yes]
  pgoutbox dlq delete --id N ... [--yes]
  pgoutbox dlq purge --older-than DUR [--topic T] [--group G] [--reason R] [--yes]

Run "pgoutbox dlq <list|show|requeue|delete|purge> --help" for flags and examples.
`

// deadLetterJSON is a dead letter in --json output.
type deadLetterJSON struct {
	ID            int64             `json:"id"`
	Topic         string            `json:"topic"`
	ConsumerGroup string            `json:"consumer_group"`
	UUID          string            `json:"uuid"`
	Metadata      map[string]string `json:"metadata"`
	jsonPayload
	CreatedAt     time.Time `json:"created_at"`
	Deliveries    int       `json:"deliveries"`
	DedupKey      string    `json:"dedup_key,omitempty"`
	OrderingKey   string    `json:"ordering_key,omitempty"`
	LastError     string    `json:"last_error,omitempty"`
	FailureReason string    `json:"failure_reason"`
	FailedBy      string    `json:"failed_by,omitempty"`
	FailedAt      time.Time `json:"failed_at"`
}

func deadLetterToJSON(d pgoutbox.DeadLetter) deadLetterJSON {
	return deadLetterJSON{
		ID: d.ID, Topic: d.Topic, ConsumerGroup: d.ConsumerGroup, UUID: d.UUID,
		Metadata: metadataMap(d.Metadata), jsonPayload: payloadJSON(d.Payload),
		CreatedAt: d.CreatedAt, Deliveries: d.Deliveries, DedupKey: d.DedupKey, OrderingKey: d.OrderingKey, LastError: d.LastError,
		FailureReason: d.FailureReason, FailedBy: d.FailedBy, FailedAt: d.FailedAt,
	}
}

func (c *cli) dlqCmd(args []string) error {
	if len(args) == 0 {
		fmt.Fprint(c.stderr, dlqUsage)
		return usagef("dlq", "missing subcommand: list, show, requeue, delete or purge")
	}
	var err error
	switch args[0] {
	case "-h", "-help", "--help", "help":
		fmt.Fprint(c.stdout, dlqUsage+"\n"+exitCodesHelp)
		return errHelp
	case "list":
		err = c.dlqList(args[1:])
	case "show":
		err = c.dlqShow(args[1:])
	case "requeue":
		err = c.dlqRequeue(args[1:])
	case "delete":
		err = c.dlqDelete(args[1:])
	case "purge":
		err = c.dlqPurge(args[1:])
	default:
		return usagef("dlq", "unknown subcommand %q; use list, show, requeue, delete or purge", args[0])
	}
	if errors.Is(err, pgoutbox.ErrNoDeadLetterTable) {
		// The library's text names its functions (Peek, RequeueParked):
		// say which commands do that.
		return &contextError{err: err, msg: "the outbox has no dead-letter table (--no-dlq): failed messages stay in the outbox, parked; " +
			"\"pgoutbox stats\" counts them (PARKED), \"pgoutbox peek --topic T [--group G]\" shows them after the pending ones (raise --limit to reach them), " +
			"and \"pgoutbox dlq requeue --no-dlq (--id N | --topic T [--group G] [--reason R] | --all)\" makes them due again"}
	}
	return err
}

// filterFlags adds --topic, --group and --reason to cmd.
func filterFlags(cmd *command, f *pgoutbox.DeadLetterFilter, group *optString) {
	cmd.fs.StringVar(&f.Topic, "topic", "", "only this topic")
	cmd.fs.Var(group, "group", "only this consumer group (--group '' is the default group)")
	cmd.fs.StringVar(&f.Reason, "reason", "", "only this failure reason: max_deliveries, retry_exhausted, rejected or poisoned (any other is refused)")
}

func (c *cli) dlqList(args []string) error {
	cmd := c.newCommand("dlq list", "dlq list [--topic T] [--group G] [--reason R] [--since T] [--until T] [--after ID] [--limit N] [--json]",
		"  pgoutbox dlq list\n  pgoutbox dlq list --topic orders.placed --reason rejected --since 24h\n  pgoutbox dlq list --after 4711   # the next page: the last id of the previous one\n  pgoutbox dlq list --json | jq -r '.dead_letters[].id'\n", true)
	cmd.inspects = true
	var f pgoutbox.DeadLetterFilter
	var group optString
	filterFlags(cmd, &f, &group)
	cmd.fs.IntVar(&f.Limit, "limit", pgoutbox.DefaultDeadLetterLimit, fmt.Sprintf("at most this many, oldest failure first (up to %d)", pgoutbox.MaxDeadLetterLimit))
	since := cmd.fs.String("since", "", "only those that failed at or after this time (RFC 3339, a local time as listed, a date, or an age before now: 30d, 24h)")
	until := cmd.fs.String("until", "", "only those that failed before this time (RFC 3339, a local time as listed, a date, or an age before now)")
	after := cmd.fs.Int64("after", 0, "start after this dead letter's id (the last one of the previous page)")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.limitInRange(f.Limit, pgoutbox.MaxDeadLetterLimit); err != nil {
		return err
	}
	sinceBound, err := cmd.timeFlag("since", *since)
	if err != nil {
		return err
	}
	untilBound, err := cmd.timeFlag("until", *until)
	if err != nil {
		return err
	}
	if *after < 0 {
		return usagef(cmd.name, "--after %d is not a dead-letter id; use the positive id the previous page ended with", *after)
	}
	f.ConsumerGroup = group.ptr()
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		if f.FailedAfter, err = sinceBound.at(ctx, exec); err != nil {
			return err
		}
		if f.FailedBefore, err = untilBound.at(ctx, exec); err != nil {
			return err
		}
		if *after > 0 {
			// A page resumes at a (failed_at, id) position: read the
			// failed_at of the id given.
			d, ok, err := pgoutbox.DeadLetterByID(ctx, exec, tables, *after)
			if err != nil {
				return err
			}
			if !ok {
				return fmt.Errorf("--after %d: no dead letter has that id (requeued or purged since?); list again with --since the failure time of the last row you saw", *after)
			}
			f.After = pgoutbox.DeadLetterCursor{FailedAt: d.FailedAt, ID: d.ID}
		}
		if !cmd.json {
			f.PayloadPrefix = 1 // the table shows no payload: not megabytes of large ones
		}
		page, err := pgoutbox.DeadLetters(ctx, exec, tables, f)
		if err != nil {
			return err
		}
		more := !page.Next.IsZero()
		if cmd.json {
			out := struct {
				DeadLetters []deadLetterJSON `json:"dead_letters"`
				More        bool             `json:"more"`
				// NextAfter is the --after of the next page, 0 when none.
				NextAfter int64 `json:"next_after,omitempty"`
			}{DeadLetters: []deadLetterJSON{}, More: more, NextAfter: page.Next.ID}
			for _, d := range page.Letters {
				out.DeadLetters = append(out.DeadLetters, deadLetterToJSON(d))
			}
			return writeJSON(c.stdout, out)
		}
		if len(page.Letters) == 0 {
			fmt.Fprintln(c.stdout, "no dead letters")
			return nil
		}
		tw := newTable(c.stdout)
		fmt.Fprintln(tw, "ID\tTOPIC\tGROUP\tREASON\tDELIVERIES\tFAILED AT\tLAST ERROR")
		for _, d := range page.Letters {
			fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\t%s\n", d.ID, plainOrQuoted(d.Topic), groupName(d.ConsumerGroup), d.FailureReason,
				d.Deliveries, listTime(d.FailedAt), short(lastErrorShown(d), 60))
		}
		tw.Flush()
		if more {
			fmt.Fprintf(c.stdout, "(more dead letters match: the next page is \"pgoutbox dlq list --after %d\" with the same filters)\n", page.Next.ID)
		}
		return nil
	})
}

func (c *cli) dlqShow(args []string) error {
	cmd := c.newCommand("dlq show", "dlq show ID [--json]", "  pgoutbox dlq show 42\n  pgoutbox dlq show 42 --json | jq -r .payload\n", true)
	cmd.inspects = true
	pos, err := cmd.parse(args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usagef(cmd.name, "give one dead-letter id (dlq list shows them)")
	}
	id, err := strconv.ParseInt(pos[0], 10, 64)
	if err != nil || id <= 0 {
		return usagef(cmd.name, "%q is not a dead-letter id; use the positive integer dlq list shows", pos[0])
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		d, ok, err := pgoutbox.DeadLetterByID(ctx, exec, tables, id)
		if err != nil {
			return err
		}
		if !ok {
			return fmt.Errorf("no dead letter with id %d; run \"pgoutbox dlq list\" for the ids (a requeued one is back in the outbox: see \"pgoutbox peek\")", id)
		}
		if cmd.json {
			return writeJSON(c.stdout, deadLetterToJSON(d))
		}
		w := c.stdout
		fmt.Fprintf(w, "ID:           %d\nTopic:        %s\nGroup:        %s\nUUID:         %s\n", d.ID, d.Topic, groupName(d.ConsumerGroup), d.UUID)
		fmt.Fprintf(w, "Created at:   %s\nFailed at:    %s\nFailed by:    %s\n", d.CreatedAt.Local().Format(time.RFC3339), d.FailedAt.Local().Format(time.RFC3339), d.FailedBy)
		fmt.Fprintf(w, "Reason:       %s\nDeliveries:   %d\nDedup key:    %s\nOrdering key: %s\nLast error:   %s\n", d.FailureReason, d.Deliveries, d.DedupKey, d.OrderingKey, lastErrorShown(d))
		fmt.Fprintln(w, "Metadata:")
		for k, v := range d.Metadata {
			fmt.Fprintf(w, "  %s=%s\n", k, v)
		}
		fmt.Fprintln(w, "Payload:")
		printPayload(w, d.Payload)
		return nil
	})
}

func (c *cli) dlqRequeue(args []string) error {
	cmd := c.newCommand("dlq requeue", "dlq requeue (--id N [--id N ...] | [--topic T] [--group G] [--reason R] [--limit N] | --all) [--yes]   (exits 1 when an --id was not requeued)",
		"  pgoutbox dlq requeue --id 42 --id 43 --yes\n  pgoutbox dlq requeue --topic orders.placed --reason retry_exhausted\n  pgoutbox dlq requeue --all --yes\n  pgoutbox dlq requeue --no-dlq --topic orders.placed --yes   # parked rows, without a dead-letter table\n", false)
	var ids idList
	cmd.fs.Var(&ids, "id", "a dead-letter id to requeue (repeat, or separate with commas)")
	var f pgoutbox.DeadLetterFilter
	var group optString
	filterFlags(cmd, &f, &group)
	cmd.fs.IntVar(&f.Limit, "limit", 0, "with filters: requeue at most this many, oldest failure first (0: all)")
	all := cmd.fs.Bool("all", false, "requeue every dead letter")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	f.ConsumerGroup = group.ptr()
	filtered := f.Topic != "" || f.ConsumerGroup != nil || f.Reason != ""
	switch {
	case len(ids) > 0 && (filtered || *all):
		return usagef(cmd.name, "--id does not go with --topic, --group, --reason or --all; use one way")
	case len(ids) == 0 && !filtered && !*all:
		return usagef(cmd.name, "say what to requeue: --id N, filters (--topic, --group, --reason), or --all")
	case *all && filtered:
		return usagef(cmd.name, "--all does not go with filters; drop --all to requeue what the filters match")
	case f.Limit < 0:
		return usagef(cmd.name, "--limit %d is negative; use 0 for all matches or a positive count", f.Limit)
	}
	what := fmt.Sprintf("%d dead letter(s) by id", len(ids))
	if len(ids) == 0 {
		what = "every dead letter matching " + describeFilter(f)
	}
	confirm := func() error { return c.confirm(cmd.name, "Requeue "+what+"?", *yes) }
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		var n int64
		start, startErr := dbclock.Now(ctx, exec) // dead letters' failure times are the database's
		topics := []string{f.Topic}               // whose messages nobody consumes to warn about; "": every topic
		if len(ids) > 0 && f.Topic == "" && !tables.NoDeadLetterTable {
			topics = deadLetterTopics(ctx, exec, tables, ids)
		}
		var err error
		switch {
		case tables.NoDeadLetterTable:
			// Without a dead-letter table failed rows are parked in the outbox.
			pf := pgoutbox.ParkedFilter{Topic: f.Topic, ConsumerGroup: f.ConsumerGroup, Reason: f.Reason, Limit: f.Limit}
			if len(ids) > 0 {
				pf.IDs = ids
			}
			n, err = pgoutbox.RequeueParked(ctx, exec, tables, pf)
		case len(ids) > 0:
			n, err = pgoutbox.RequeueDeadLetters(ctx, exec, tables, ids)
		default:
			n, err = pgoutbox.RequeueDeadLettersMatching(ctx, exec, tables, f)
		}
		if err != nil {
			return err
		}
		if tables.NoDeadLetterTable {
			fmt.Fprintf(c.stdout, "requeued %d parked message(s)\n", n)
		} else {
			fmt.Fprintf(c.stdout, "requeued %d dead letter(s)\n", n)
		}
		if n > 0 && !tables.NoDeadLetterTable {
			// A dead letter goes back to the group that failed it: say so
			// if that group is no longer bound (renamed, unbound), as
			// stats does, of the topics requeued only. A courtesy: nothing
			// is said if Stats fails.
			for _, topic := range topics {
				var opts []pgoutbox.StatsOption
				if topic != "" {
					opts = append(opts, pgoutbox.StatsForTopic(topic))
				}
				if st, err := pgoutbox.Stats(ctx, exec, tables, opts...); err == nil {
					printUnboundWarnings(c.stdout, st)
				}
			}
		}
		if len(ids) == 0 && n == 0 && !tables.NoDeadLetterTable {
			// A filter that matched nothing is often a mistyped topic or
			// group: name what the dead-letter table holds (a courtesy,
			// as above).
			if held, err := deadLetterCounts(ctx, exec, tables); err == nil {
				printNoMatchingDeadLetters(c.stderr, f, held)
			}
		}
		if len(ids) == 0 {
			if !tables.NoDeadLetterTable && startErr == nil && (f.Limit == 0 || n < int64(f.Limit)) {
				// What still matches and failed before the requeue stayed: a
				// message in the outbox holds its dedup key or id. One that
				// failed since was requeued, taken and failed again.
				left := f
				left.Limit = pgoutbox.DefaultDeadLetterLimit
				left.FailedBefore = dbclock.Before(left.FailedBefore, start)
				if page, err := pgoutbox.DeadLetters(ctx, exec, tables, left); err == nil && len(page.Letters) > 0 {
					count := strconv.Itoa(len(page.Letters))
					if page.Next != (pgoutbox.DeadLetterCursor{}) {
						count += " or more"
					}
					fmt.Fprintf(c.stdout, "%s matching dead letter(s) stayed (first id %d): a message in the outbox holds the dedup key (or the id) of each; requeue them once that message is gone\n",
						count, page.Letters[0].ID)
				}
			}
			return nil
		}
		if n >= int64(len(ids)) {
			return nil
		}
		// Nothing to act on for some ids: exit 1, as dlq delete does.
		missed := int64(len(ids)) - n
		if tables.NoDeadLetterTable {
			return fmt.Errorf("%d of the ids were not parked messages (requeued already, deleted, or mistyped; \"pgoutbox peek --topic T\" shows the parked ones)", missed)
		}
		// A dead letter whose dedup key a message in the outbox holds
		// stays a dead letter: tell those from ids that are gone.
		var held []int64
		for _, id := range ids {
			if _, ok, err := pgoutbox.DeadLetterByID(ctx, exec, tables, id); err == nil && ok {
				held = append(held, id)
			}
		}
		if len(held) == 0 {
			return fmt.Errorf("%d of the ids were not dead letters (already requeued, purged, or mistyped; see \"pgoutbox dlq list\")", missed)
		}
		msg := fmt.Sprintf("%d of the ids were not requeued: %s still dead letter(s), as a message in the outbox holds each one's dedup key (requeue it once that message is gone)", missed, joinIDs(held))
		if gone := missed - int64(len(held)); gone > 0 {
			msg += fmt.Sprintf("; %d were not dead letters (already requeued, purged, or mistyped; see \"pgoutbox dlq list\")", gone)
		}
		return errors.New(msg)
	})
}

// deadLetterCount is how many dead letters a topic and group hold.
type deadLetterCount struct {
	topic, group string
	n            int64
}

// deadLetterCounts reads the dead letters per topic and group, ordered
// by both: the dead-letter table alone.
func deadLetterCounts(ctx context.Context, exec tx.Executor, tables schema.Config) ([]deadLetterCount, error) {
	t := tables.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return nil, err
	}
	rows, err := exec.Query(ctx, query.DLQStats(n, false, false))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []deadLetterCount
	for rows.Next() {
		var c deadLetterCount
		var reason string
		if err := rows.Scan(&c.topic, &c.group, &reason, &c.n); err != nil {
			return nil, err
		}
		if k := len(out) - 1; k >= 0 && out[k].topic == c.topic && out[k].group == c.group {
			out[k].n += c.n
			continue
		}
		out = append(out, c)
	}
	return out, rows.Err()
}

// printNoMatchingDeadLetters says, after a filtered requeue that took
// nothing, which filter matched no dead letter at all and which topics and
// groups hold dead letters; nothing when the filters match dead letters
// (their reason or limit left them out, or they stayed).
func printNoMatchingDeadLetters(w io.Writer, f pgoutbox.DeadLetterFilter, counts []deadLetterCount) {
	var topicHas, groupHas bool
	var held []string
	for _, c := range counts {
		held = append(held, fmt.Sprintf("topic %q group %s (%d)", c.topic, groupName(c.group), c.n))
		topicHas = topicHas || c.topic == f.Topic
		groupHas = groupHas || (f.ConsumerGroup != nil && c.group == *f.ConsumerGroup && (f.Topic == "" || c.topic == f.Topic))
	}
	var missing string
	switch {
	case f.Topic != "" && !topicHas:
		missing = fmt.Sprintf("no dead letter has topic %q", f.Topic)
	case f.ConsumerGroup != nil && !groupHas:
		missing = fmt.Sprintf("no dead letter has group %s", groupName(*f.ConsumerGroup))
		if f.Topic != "" {
			missing += fmt.Sprintf(" on topic %q", f.Topic)
		}
	default:
		return
	}
	if len(held) == 0 {
		fmt.Fprintf(w, "pgoutbox: note: %s; the dead-letter table is empty\n", missing)
		return
	}
	const shown = 10
	more := ""
	if len(held) > shown {
		more = fmt.Sprintf(" and %d more", len(held)-shown)
		held = held[:shown]
	}
	fmt.Fprintf(w, "pgoutbox: note: %s (mistyped?); dead letters are held by %s%s (\"pgoutbox dlq list\" shows them)\n", missing, strings.Join(held, ", "), more)
}

// joinIDs lists ids as "42, 43".
func joinIDs(ids []int64) string {
	s := make([]string, len(ids))
	for i, id := range ids {
		s[i] = strconv.FormatInt(id, 10)
	}
	return strings.Join(s, ", ")
}

func describeFilter(f pgoutbox.DeadLetterFilter) string {
	s := ""
	if f.Topic != "" {
		s += fmt.Sprintf(" topic=%q", f.Topic)
	}
	if f.ConsumerGroup != nil {
		s += fmt.Sprintf(" group=%q", *f.ConsumerGroup)
	}
	if f.Reason != "" {
		s += fmt.Sprintf(" reason=%q", f.Reason)
	}
	if s == "" {
		return "(all)"
	}
	if f.Limit > 0 {
		s += fmt.Sprintf(" (at most %d)", f.Limit)
	}
	return s[1:]
}

func (c *cli) dlqDelete(args []string) error {
	cmd := c.newCommand("dlq delete", "dlq delete --id N [--id N ...] [--yes]   (exits 1 when an --id is not a dead letter)",
		"  pgoutbox dlq delete --id 42 --yes\n  pgoutbox dlq delete --id 42,43 --yes\n", false)
	var ids idList
	cmd.fs.Var(&ids, "id", "a dead-letter id to delete (repeat, or separate with commas)")
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if len(ids) == 0 {
		return usagef(cmd.name, "say which dead letters to delete: --id N (dlq list shows the ids); dlq purge deletes by age")
	}
	confirm := func() error {
		return c.confirm(cmd.name, fmt.Sprintf("Delete %d dead letter(s) for good?", len(ids)), *yes)
	}
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.DeleteDeadLetters(ctx, exec, tables, ids)
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "deleted %d dead letter(s)\n", n)
		if n < int64(len(ids)) {
			return fmt.Errorf("%d of the ids were not dead letters (already requeued, purged, or mistyped; see \"pgoutbox dlq list\")", int64(len(ids))-n)
		}
		return nil
	})
}

// timeFlag reads a --since/--until value: an RFC 3339 time, a local time
// as the lists print it (2026-01-02 15:04:05 CET, the zone optional), a
// date (its midnight, local time), or an age before now as --older-than
// takes it (30d, 24h, 90m). "" is no bound.
func (cmd *command) timeFlag(name, v string) (timeBound, error) {
	if v == "" {
		return timeBound{}, nil
	}
	if t, err := time.Parse(time.RFC3339Nano, v); err == nil {
		return timeBound{time: t}, nil
	}
	if t, err := time.ParseInLocation(time.DateTime, v, time.Local); err == nil {
		return timeBound{time: t}, nil
	}
	if t, err := time.ParseInLocation(listTimeLayout, v, time.Local); err == nil {
		// An abbreviation this machine's zone does not know reads as UTC
		// (Go's rule): refuse it rather than be off by its offset.
		if zone, offset := t.Zone(); offset != 0 || zone == "UTC" || zone == "GMT" {
			return timeBound{time: t}, nil
		}
		return timeBound{}, usagef(cmd.name, "--%s %q: the zone %s is not this machine's (%s); give an RFC 3339 time with its offset (2026-01-02T15:04:05+01:00)", name, v, strings.Fields(v)[len(strings.Fields(v))-1], time.Now().Format("MST"))
	}
	if t, err := time.ParseInLocation(time.DateOnly, v, time.Local); err == nil {
		return timeBound{time: t}, nil
	}
	if d, ok := olderthan.Parse(v); ok {
		return timeBound{age: d, isAge: true}, nil
	}
	return timeBound{}, usagef(cmd.name, "--%s %q is neither an RFC 3339 time (2026-01-02T15:04:05Z), a local time as the lists print it (\"2026-01-02 15:04:05 %s\"), a date (2026-01-02) nor an age before now (30d, 24h, 90m)", name, v, time.Now().Format("MST"))
}

// listTime is how the tables print a time: local, with its zone's
// abbreviation (or offset), which --since and --until read back.
func listTime(t time.Time) string { return t.Local().Format(listTimeLayout) }

const listTimeLayout = "2006-01-02 15:04:05 MST"

// timeBound is a time flag's value: a time, or an age before the
// database's now (failed_at is the database's time, and this machine's
// clock may be off by any amount).
type timeBound struct {
	time  time.Time
	age   time.Duration
	isAge bool
}

// at returns the bound's time, reading the database's clock for an age.
func (b timeBound) at(ctx context.Context, exec tx.Executor) (time.Time, error) {
	if !b.isAge {
		return b.time, nil
	}
	now, err := dbclock.Now(ctx, exec)
	return now.Add(-b.age), err
}

func (c *cli) dlqPurge(args []string) error {
	cmd := c.newCommand("dlq purge", "dlq purge --older-than DUR [--topic T] [--group G] [--reason R] [--yes]",
		"  pgoutbox dlq purge --older-than 720h --yes   # failed more than 30 days ago\n  pgoutbox dlq purge --older-than 0 --yes      # every dead letter\n  pgoutbox dlq purge --older-than 720h --topic orders.placed --group billing --yes\n", false)
	olderThan := cmd.fs.String("older-than", "", "delete dead letters that failed longer ago than this age (30d, 720h, 90m; 0 for all)")
	var f pgoutbox.DeadLetterFilter
	var group optString
	filterFlags(cmd, &f, &group)
	yes := cmd.fs.Bool("yes", false, "do not ask for confirmation")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if *olderThan == "" {
		return usagef(cmd.name, "--older-than is required (e.g. --older-than 720h; 0 deletes every dead letter)")
	}
	d, ok := olderthan.Parse(*olderThan)
	if !ok {
		return usagef(cmd.name, "--older-than %q is not an age; use days or a Go duration such as 30d, 720h or 90m (0 for all)", *olderThan)
	}
	f.ConsumerGroup = group.ptr()
	q := fmt.Sprintf("Delete dead letters that failed more than %s ago", d)
	if d == 0 {
		q = "Delete every dead letter"
	}
	if f != (pgoutbox.DeadLetterFilter{}) {
		q += " matching " + describeFilter(f)
	}
	q += "?"
	confirm := func() error { return c.confirm(cmd.name, q, *yes) }
	return cmd.withOutbox(context.Background(), confirm, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		n, err := pgoutbox.PurgeDeadLettersMatching(ctx, exec, tables, d, f, 0)
		if err != nil {
			return err
		}
		fmt.Fprintf(c.stdout, "purged %d dead letter(s)\n", n)
		return nil
	})
}

// lastErrorShown is a dead letter's last error as the tables show it. A
// message dead-lettered at MaxDeliveries without an error had no delivery
// that ended with one: the likely causes are said, not left blank.
func lastErrorShown(d pgoutbox.DeadLetter) string {
	if d.LastError == "" && d.FailureReason == pgoutbox.ReasonMaxDeliveries {
		return "(none recorded: the handler may crash its process, outlive its Lease, or nack without an error)"
	}
	return d.LastError
}

// deadLetterTopics returns the topics of the dead letters with ids, read
// before they are requeued; none when that cannot be read.
func deadLetterTopics(ctx context.Context, exec tx.Executor, tables schema.Config, ids []int64) []string {
	t := tables.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return nil
	}
	rows, err := exec.Query(ctx, query.DeadLetterTopics(n), ids)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var topics []string
	for rows.Next() {
		var topic string
		if rows.Scan(&topic) != nil {
			return nil
		}
		topics = append(topics, topic)
	}
	if rows.Err() != nil {
		return nil
	}
	return topics
}
