package pgoutbox

import (
	"cmp"
	"context"
	"slices"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// QueueStats is the state of one consumer group's copy of one topic.
type QueueStats struct {
	Topic         string
	ConsumerGroup string // "" is the default group
	// Bound tells whether the group is bound to the topic. The rows of a
	// group that is not bound wait for nobody (see Unbound): a group
	// unbound while it still had messages, or, for the default group "",
	// messages published while the topic had no binding, which the next
	// group to bind the topic adopts (see BindGroups).
	Bound bool
	// Ready rows are due now and not leased: waiting for a consumer.
	Ready int64
	// Scheduled rows are due later (DeliverAfter, DeliverAt, retry
	// backoff), not parked.
	Scheduled int64
	// Leased rows are held by a consumer whose lease is still running.
	Leased int64
	// ExpiredLeases are leased rows whose lease ran out (their holder died
	// or stalled); the next claim of the group takes them.
	ExpiredLeases int64
	// Parked rows failed terminally in an outbox without a dead-letter
	// table (available_at = 'infinity'); see RequeueParked.
	Parked int64
	// OldestReadyAge is how long the oldest ready row has been due: the
	// group's lag. 0 when nothing is ready.
	OldestReadyAge time.Duration
	// DeadLetters counts the group's rows in the dead-letter table by
	// failure reason ("max_deliveries", "retry_exhausted", "rejected",
	// "poisoned"). Empty without a dead-letter table.
	DeadLetters map[string]int64
	// Paused is set while the group is paused on this topic (PauseGroup):
	// its rows wait, nothing of it is claimed. PausedAt is when the pause
	// began (zero when not paused).
	Paused   bool
	PausedAt time.Time
}

// Unbound is the number of the group's messages that no bound group will
// consume: every row of it, leased ones included, when the group is not
// bound to the topic; 0 when it is. An alert on it finds messages
// stranded by a binding mistake (pgoutbox move hands them on).
func (s QueueStats) Unbound() int64 {
	if s.Bound {
		return 0
	}
	return s.Ready + s.Scheduled + s.Leased + s.ExpiredLeases + s.Parked
}

// StatsOption narrows Stats.
type StatsOption func(*statsOptions)

type statsOptions struct {
	topic, group       string
	hasTopic, hasGroup bool
}

// StatsForTopic makes Stats report the consumer groups of topic only.
func StatsForTopic(topic string) StatsOption {
	return func(o *statsOptions) { o.topic, o.hasTopic = topic, true }
}

// StatsForGroup makes Stats report one consumer group ("" is the default
// group) of topic only; the result then always holds exactly one entry,
// zeros included.
func StatsForGroup(topic, group string) StatsOption {
	return func(o *statsOptions) {
		o.topic, o.hasTopic = topic, true
		o.group, o.hasGroup = group, true
	}
}

// Stats reports the state of the outbox, one QueueStats per topic and
// consumer group, ordered by topic then group. Without options it covers
// every topic: each group bound to a topic (with zeros when it has no
// rows), and every (topic, group) that has rows. It runs in exec's
// transaction when exec is one, and writes nothing.
//
// It is built for scraping (every 15 s is fine): the pairs are found with a
// loose index scan, and each pair's counts are two range scans of the
// outbox's partial indexes, so the cost follows the number of rows counted,
// never the table's dead tuples or payloads. Measured on 1,000,000 rows: see
// the README (Operations). Dead-letter counts read the dead-letter table
// unless tables sets NoDeadLetterTable (with a topic, through its (topic,
// failed_at) index); a dead-letter table named but missing is an error.
func Stats(ctx context.Context, exec tx.Executor, tables schema.Config, opts ...StatsOption) ([]QueueStats, error) {
	var o statsOptions
	for _, opt := range opts {
		if opt != nil {
			opt(&o)
		}
	}
	q, err := opsQueries(exec, tables)
	if err != nil {
		return nil, err
	}
	var args []any
	if o.hasTopic {
		if err := checkTopic(o.topic); err != nil {
			return nil, err
		}
		args = append(args, o.topic)
	}
	if o.hasGroup {
		if err := checkGroup(o.group); err != nil {
			return nil, err
		}
		args = append(args, o.group)
	}
	n := q.Names
	rows, err := exec.Query(ctx, query.Stats(n, o.hasTopic, o.hasGroup), args...)
	if err != nil {
		return nil, errorf("pgoutbox: stats: %w%s", err, outboxMissing(err, n))
	}
	var out []QueueStats
	index := map[[2]string]int{}
	for rows.Next() {
		var s QueueStats
		var lagUS int64
		if err := rows.Scan(&s.Topic, &s.ConsumerGroup, &s.Ready, &s.Scheduled, &s.Parked, &lagUS, &s.Leased, &s.ExpiredLeases, &s.Bound); err != nil {
			rows.Close()
			return nil, errorf("pgoutbox: stats: %w", err)
		}
		if s.Ready > 0 && lagUS > 0 {
			s.OldestReadyAge = time.Duration(lagUS) * time.Microsecond
		}
		index[[2]string{s.Topic, s.ConsumerGroup}] = len(out)
		out = append(out, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, errorf("pgoutbox: stats: %w%s", err, outboxMissing(err, n))
	}
	if n, err = withReadableArrivals(ctx, exec, n); err != nil {
		return nil, errorf("pgoutbox: stats: %w", err)
	}
	if n.Arrivals {
		if out, err = addArrivals(ctx, exec, n, o, out, index); err != nil {
			return nil, err
		}
	}
	// Paused groups, with an entry of their own when they have no rows
	// and no binding (the pause of a group not yet deployed shows).
	paused, err := pausedGroups(ctx, exec, n, o.topic)
	if err != nil {
		return nil, err
	}
	sorted := true
	for _, p := range paused {
		if o.hasGroup && p.ConsumerGroup != o.group {
			continue
		}
		i, ok := index[[2]string{p.Topic, p.ConsumerGroup}]
		if !ok {
			i = len(out)
			index[[2]string{p.Topic, p.ConsumerGroup}] = i
			out = append(out, QueueStats{Topic: p.Topic, ConsumerGroup: p.ConsumerGroup})
			sorted = false
		}
		out[i].Paused, out[i].PausedAt = true, p.PausedAt
	}
	if !sorted {
		sortStats(out)
		for i, s := range out {
			index[[2]string{s.Topic, s.ConsumerGroup}] = i
		}
	}
	if n.QDLQ == "" {
		return out, nil
	}
	// A dead-letter table named but missing is a configuration that
	// does not match the outbox: counting no dead letters would silence
	// the alerts that watch them.
	exists, err := tableExists(ctx, exec, n.QDLQ)
	if err != nil {
		return nil, err
	}
	if !exists {
		return nil, errorf("pgoutbox: stats: the dead-letter table %s does not exist; name the one the outbox has (schema.Config.DeadLetterTable, --dlq-table), or set NoDeadLetterTable (--no-dlq) for an outbox without one", n.QDLQ)
	}
	rows, err = exec.Query(ctx, query.DLQStats(n, o.hasTopic, o.hasGroup), args...)
	if err != nil {
		return nil, errorf("pgoutbox: stats: dead letters: %w", err)
	}
	defer rows.Close()
	added := false
	for rows.Next() {
		var topic, group, reason string
		var count int64
		if err := rows.Scan(&topic, &group, &reason, &count); err != nil {
			return nil, errorf("pgoutbox: stats: dead letters: %w", err)
		}
		i, ok := index[[2]string{topic, group}]
		if !ok {
			// A group whose only rows are dead letters.
			i = len(out)
			index[[2]string{topic, group}] = i
			out = append(out, QueueStats{Topic: topic, ConsumerGroup: group})
			added = true
		}
		if out[i].DeadLetters == nil {
			out[i].DeadLetters = map[string]int64{}
		}
		out[i].DeadLetters[reason] = count
	}
	if err := rows.Err(); err != nil {
		return nil, errorf("pgoutbox: stats: dead letters: %w", err)
	}
	if added {
		sortStats(out)
	}
	return out, nil
}

func sortStats(s []QueueStats) {
	slices.SortFunc(s, func(a, b QueueStats) int {
		if c := cmp.Compare(a.Topic, b.Topic); c != 0 {
			return c
		}
		return cmp.Compare(a.ConsumerGroup, b.ConsumerGroup)
	})
}

// tableExists reports whether the table qname (quoted, qualified) exists.
func tableExists(ctx context.Context, exec tx.Executor, qname string) (bool, error) {
	rows, err := exec.Query(ctx, query.TableExists, qname)
	if err != nil {
		return false, errorf("pgoutbox: look up table %s: %w", qname, err)
	}
	defer rows.Close()
	var ok bool
	if rows.Next() {
		err = rows.Scan(&ok)
	}
	if err == nil {
		err = rows.Err()
	}
	if err != nil {
		return false, errorf("pgoutbox: look up table %s: %w", qname, err)
	}
	return ok, nil
}

func opsQueries(exec tx.Executor, tables schema.Config) (*query.Queries, error) {
	if exec == nil {
		return nil, errorf("%w: executor is nil; pass tx.FromPgxPool(pool) or another tx executor", ErrInvalidConfig)
	}
	return queriesForTables(tables, false)
}

// addArrivals counts, with an outbox with arrivals, each arrival as a
// ready message of every group it belongs to (query.ArrivalsStats); an
// arrival no group is bound for yet counts for the default group, unbound
// (as a message published while its topic has no binding).
func addArrivals(ctx context.Context, exec tx.Executor, n query.Names, o statsOptions, out []QueueStats, index map[[2]string]int) ([]QueueStats, error) {
	var args []any
	if o.hasTopic {
		args = append(args, o.topic)
	}
	rows, err := exec.Query(ctx, query.ArrivalsStats(n, o.hasTopic), args...)
	if err != nil {
		return nil, errorf("pgoutbox: stats: arrivals: %w", err)
	}
	defer rows.Close()
	added := false
	for rows.Next() {
		var topic string
		var group *string
		var count, lagUS int64
		if err := rows.Scan(&topic, &group, &count, &lagUS); err != nil {
			return nil, errorf("pgoutbox: stats: arrivals: %w", err)
		}
		g := ""
		if group != nil {
			g = *group
		}
		if o.hasGroup && g != o.group {
			continue
		}
		i, ok := index[[2]string{topic, g}]
		if !ok {
			i = len(out)
			index[[2]string{topic, g}] = i
			out = append(out, QueueStats{Topic: topic, ConsumerGroup: g, Bound: group != nil})
			added = true
		}
		out[i].Ready += count
		out[i].OldestReadyAge = max(out[i].OldestReadyAge, time.Duration(lagUS)*time.Microsecond)
	}
	if err := rows.Err(); err != nil {
		return nil, errorf("pgoutbox: stats: arrivals: %w", err)
	}
	if added {
		sortStats(out)
		clear(index)
		for i, s := range out {
			index[[2]string{s.Topic, s.ConsumerGroup}] = i
		}
	}
	return out, nil
}

// withReadableArrivals returns n with its arrivals table when the outbox
// has one the role may read, whether or not the caller's Tables say so:
// an operator's tool (Stats, Peek) must see every message waiting.
func withReadableArrivals(ctx context.Context, exec tx.Executor, n query.Names) (query.Names, error) {
	if n.Arrivals || n.Rotating {
		return n, nil
	}
	withArrivals := n.WithArrivals()
	var readable bool
	if err := queryRow(ctx, exec, query.ReadableArrivals, []any{withArrivals.QArrivals, n.QTable}, &readable); err != nil {
		return n, err
	}
	if readable {
		return withArrivals, nil
	}
	return n, nil
}
