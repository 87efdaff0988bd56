package pgoutboxtest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
)

// Collect receives n messages from msgs, acks each, and returns them in
// the order they arrived. It fails the test, with how many are missing and
// what did arrive, when they do not all arrive within timeout or msgs is
// closed first.
func Collect(t testing.TB, msgs <-chan *message.Message, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	got := make([]*message.Message, 0, n)
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for len(got) < n {
		select {
		case m, ok := <-msgs:
			if !ok {
				t.Fatalf("pgoutboxtest: the channel closed after %d of %d message(s); %d missing.%s", len(got), n, n-len(got), received(got))
				return got
			}
			m.Ack()
			got = append(got, m)
		case <-deadline.C:
			t.Fatalf("pgoutboxtest: received %d of %d message(s) within %s; %d missing.%s", len(got), n, timeout, n-len(got), received(got))
			return got
		}
	}
	return got
}

// Drain subscribes to topic on sub, receives and acks n messages (see
// Collect), ends the subscription and waits until its channel closes: with
// a pgoutbox subscriber the acks are then written, so the outbox no longer
// holds the drained messages. A message handed out after the n-th is
// nacked (pgoutbox delivers it again). Each call is a subscription of its
// own: messages it did not take stay for the next one.
func Drain(t testing.TB, sub message.Subscriber, topic string, n int, timeout time.Duration) []*message.Message {
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
	got := Collect(t, msgs, n, timeout)
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

// Drain is the package's Drain on Env.Subscriber.
func (e *Env) Drain(t testing.TB, topic string, n int, timeout time.Duration) []*message.Message {
	t.Helper()
	return Drain(t, e.Subscriber, topic, n, timeout)
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
