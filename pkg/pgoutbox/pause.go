package pgoutbox

import (
	"context"
	"fmt"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// PauseGroup pauses consumer group group ("" is the default group) of
// topic: from the next claim on, no subscriber of that group, in any
// process and on any claim path, claims its rows of the topic, until
// ResumeGroup. Publishing goes on (the group's backlog grows), and so do
// the group's other topics and the topic's other groups.
//
// Messages already claimed when the pause commits are not taken back: a
// handler running finishes, and its ack, nack or dead letter is written
// as usual; rows a subscriber prefetched (leased, not yet handed to a
// handler, at most its prefetch) are still handed out. A nacked message
// goes back to the queue and waits there. Expired leases are not reclaimed
// while paused.
//
// The pause is durable (a row of the paused-groups table, <table>_paused)
// and needs no binding: a group can be paused before its first subscriber
// starts, or while its rows are stranded. Pausing a paused group is a
// no-op. It runs in exec's transaction when exec is one (it takes effect
// when that commits).
func PauseGroup(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string) error {
	q, err := groupQueries(exec, tables, topic, group)
	if err != nil {
		return err
	}
	if _, err := exec.Exec(ctx, query.Pause(q.Names), topic, group); err != nil {
		return fmt.Errorf("pgoutbox: pause group %q of topic %q: %w", group, topic, err)
	}
	return nil
}

// ResumeGroup ends the pause of group ("" is the default group) of topic
// and wakes the group's idle subscribers at once (a NOTIFY, sent when the
// transaction commits), so its backlog is claimed without waiting for a
// poll. It reports whether the group was paused; resuming a group that is
// not paused is a no-op. It runs in exec's transaction when exec is one.
func ResumeGroup(ctx context.Context, exec tx.Executor, tables schema.Config, topic, group string) (bool, error) {
	q, err := groupQueries(exec, tables, topic, group)
	if err != nil {
		return false, err
	}
	rows, err := exec.Query(ctx, query.Resume(q.Names), topic, group, q.Names.Channel)
	if err != nil {
		return false, fmt.Errorf("pgoutbox: resume group %q of topic %q: %w", group, topic, err)
	}
	defer rows.Close()
	var was bool
	var woken int64
	if rows.Next() {
		err = rows.Scan(&was, &woken)
	}
	if err == nil {
		err = rows.Err()
	}
	if err != nil {
		return false, fmt.Errorf("pgoutbox: resume group %q of topic %q: %w", group, topic, err)
	}
	return was, nil
}

// PausedGroup is one paused consumer group of a topic.
type PausedGroup struct {
	Topic         string
	ConsumerGroup string // "" is the default group
	PausedAt      time.Time
}

// PausedGroups lists the paused groups, ordered by topic then group; of
// topic only when topic is not "". It writes nothing. On a schema created
// before pausing existed (no paused-groups table) it returns none.
func PausedGroups(ctx context.Context, exec tx.Executor, tables schema.Config, topic string) ([]PausedGroup, error) {
	q, err := opsQueries(exec, tables)
	if err != nil {
		return nil, err
	}
	if topic != "" {
		if err := checkTopic(topic); err != nil {
			return nil, err
		}
	}
	return pausedGroups(ctx, exec, q.Names, topic)
}

func pausedGroups(ctx context.Context, exec tx.Executor, n query.Names, topic string) ([]PausedGroup, error) {
	exists, err := tableExists(ctx, exec, n.QPaused())
	if err != nil || !exists {
		return nil, err
	}
	var args []any
	if topic != "" {
		args = append(args, topic)
	}
	rows, err := exec.Query(ctx, query.PausedGroups(n, topic != ""), args...)
	if err != nil {
		return nil, errorf("pgoutbox: list paused groups: %w", err)
	}
	defer rows.Close()
	var out []PausedGroup
	for rows.Next() {
		var p PausedGroup
		if err := rows.Scan(&p.Topic, &p.ConsumerGroup, &p.PausedAt); err != nil {
			return nil, errorf("pgoutbox: list paused groups: %w", err)
		}
		out = append(out, p)
	}
	if err := rows.Err(); err != nil {
		return nil, errorf("pgoutbox: list paused groups: %w", err)
	}
	return out, nil
}
