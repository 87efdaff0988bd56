package pgoutboxtest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
)

// Collect receives n messages from msgs, acks each, and returns them in
// the order they arrived. It fails the test, with how many are missing and
// what did arrive, when they do not all arrive within timeout or msgs is
// closed first. It returns once the messages are acked, not once their acks
// are written: a pgoutbox subscriber writes acks in batches, so the outbox
// may hold the last of them for a few more milliseconds. Before asserting
// that the outbox no longer holds them (RequireNotPublished), end the
// subscription and wait for msgs to close, or use Drain, which does.
func Collect(t testing.TB, msgs <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	got, problem := collect(msgs, n, timeout)
	if problem != "" {
		t.Fatalf("%s", problem)
	}
	return got
}

// collect is Collect with its failure returned, so that a caller that
// knows the outbox can say why the messages may be missing.
func collect(msgs <-chan *message.Message, n int, timeout time.Duration) ([]*message.Message, string) {
	if n < 0 {
		return nil, fmt.Sprintf("pgoutboxtest: asked for %d messages; ask for 0 or more", n)
	}
	got := make([]*message.Message, 0, n)
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for len(got) < n {
		select {
		case m, ok := <-msgs:
			if !ok {
				return got, fmt.Sprintf("pgoutboxtest: the channel closed after %d of %d message(s); %d missing.%s", len(got), n, n-len(got), received(got))
			}
			m.Ack()
			got = append(got, m)
		case <-deadline.C:
			return got, fmt.Sprintf("pgoutboxtest: received %d of %d message(s) within %s; %d missing.%s", len(got), n, timeout, n-len(got), received(got))
		}
	}
	return got, ""
}

// Drain subscribes to topic on sub, receives and acks n messages (see
// Collect), ends the subscription and waits until its channel closes: with
// a pgoutbox subscriber the acks are then written, so the outbox no longer
// holds the drained messages. A message handed out after the n-th is
// nacked (pgoutbox delivers it again). Each call is a subscription of its
// own: messages it did not take stay for the next one.
func Drain(t testing.TB, sub message.Subscriber, topic string, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	return drain(t, sub, topic, n, timeout, nil)
}

// drain is Drain; hint, when not nil, adds to a failure to collect n
// messages what the outbox tells of why.
func drain(t testing.TB, sub message.Subscriber, topic string, n int, timeout time.Duration, hint func() string) []*message.Message {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	msgs, err := sub.Subscribe(ctx, topic)
	if err != nil {
		t.Fatalf("pgoutboxtest: subscribe to %q: %v", topic, err)
		return nil
	}
	closed := false
	defer func() {
		if closed {
			return
		}
		// Collect failed (Fatalf): end the subscription without waiting.
		cancel()
		go func() {
			for m := range msgs {
				m.Nack()
			}
		}()
	}()
	got, problem := collect(msgs, n, timeout)
	if problem != "" {
		if hint != nil {
			problem += hint()
		}
		t.Fatalf("%s", problem)
		return got
	}
	cancel()
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		select {
		case m, ok := <-msgs:
			if !ok {
				closed = true
				return got
			}
			m.Nack()
		case <-deadline.C:
			t.Fatalf("pgoutboxtest: the subscription to %q did not end within %s after receiving %d message(s)", topic, timeout, n)
			return got
		}
	}
}

// Drain is the package's Drain on Env.Subscriber. When the messages do not
// all arrive, the failure also says which consumer groups the topic was
// bound to before Env.Subscriber's group and which groups hold the topic's
// messages: a message published before a group's binding goes only to the
// groups bound then (docs/consumer-groups.md).
func (e *Env) Drain(t testing.TB, topic string, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	return drain(t, e.Subscriber, topic, n, timeout, func() string {
		return e.groupsHint(topic, e.Subscriber.ConsumerGroup())
	})
}

// groupsHint reads the topic's bindings and where its messages wait, for
// a failure message; it is empty when that shows nothing amiss.
func (e *Env) groupsHint(topic, group string) string {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t := e.Tables.WithDefaults()
	n, err := query.NewNames(t.Schema, t.Table, t.DeadLetterTable)
	if err != nil {
		return ""
	}
	var b strings.Builder
	var mine *time.Time
	var earlier []string
	rows, err := e.Pool.Query(ctx, `SELECT consumer_group, bound_at FROM `+n.QBindings+` WHERE topic = $1 ORDER BY bound_at, consumer_group`, topic)
	if err != nil {
		return fmt.Sprintf("\n(the topic's bindings could not be read: %v)", err)
	}
	type binding struct {
		group   string
		boundAt time.Time
	}
	var bound []binding
	for rows.Next() {
		var bd binding
		if err := rows.Scan(&bd.group, &bd.boundAt); err != nil {
			rows.Close()
			return ""
		}
		bound = append(bound, bd)
	}
	rows.Close()
	for _, bd := range bound {
		if bd.group == group {
			mine = &bd.boundAt
		}
	}
	for _, bd := range bound {
		if bd.group != group && (mine == nil || bd.boundAt.Before(*mine)) {
			earlier = append(earlier, fmt.Sprintf("%q", bd.group))
		}
	}
	if len(earlier) > 0 {
		fmt.Fprintf(&b, "\nThe topic %q was bound to the consumer group(s) %s before this subscriber's group %q", topic, strings.Join(earlier, ", "), group)
		if mine != nil {
			fmt.Fprintf(&b, " (bound at %s)", mine.UTC().Format(time.RFC3339Nano))
		}
		b.WriteString(": a message published before a group's binding goes only to the groups bound then. " +
			"Bind every group before publishing (pgoutbox.Bind, pgoutbox.BindSubscribers), " +
			"bind with pgoutbox.StartFromBacklog, or drain with a subscriber of the group that holds them (Options.ConsumerGroup, Env.NewSubscriber).")
	}
	var waiting []string
	rows, err = e.Pool.Query(ctx, `SELECT consumer_group, count(*) FROM `+n.QTable+` WHERE topic = $1 GROUP BY 1 ORDER BY 1`, topic)
	if err == nil {
		for rows.Next() {
			var g string
			var c int64
			if rows.Scan(&g, &c) == nil {
				waiting = append(waiting, fmt.Sprintf("%q: %d", g, c))
			}
		}
		rows.Close()
	}
	if len(waiting) > 0 && len(earlier) > 0 {
		fmt.Fprintf(&b, "\nThe outbox holds the topic's messages for the group(s) %s.", strings.Join(waiting, ", "))
	}
	return b.String()
}

func received(got []*message.Message) string {
	if len(got) == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(" Received:")
	for i, m := range got {
		if i == 20 {
			fmt.Fprintf(&b, "\n  ... and %d more", len(got)-20)
			break
		}
		fmt.Fprintf(&b, "\n  %d. uuid=%s payload=%s", i+1, m.UUID, show(m.Payload))
	}
	return b.String()
}
