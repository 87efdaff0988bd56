package main

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/internal/payloadcut"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// pendingJSON is a pending message in peek --json output.
type pendingJSON struct {
	ID       int64             `json:"id"`
	UUID     string            `json:"uuid"`
	Metadata map[string]string `json:"metadata"`
	jsonPayload
	CreatedAt     time.Time  `json:"created_at"`
	AvailableAt   *time.Time `json:"available_at"` // null when parked
	Parked        bool       `json:"parked"`
	Deliveries    int        `json:"deliveries"`
	DedupKey      string     `json:"dedup_key,omitempty"`
	OrderingKey   string     `json:"ordering_key,omitempty"`
	LastError     string     `json:"last_error,omitempty"`
	FailureReason string     `json:"failure_reason,omitempty"`
}

func (c *cli) peekCmd(args []string) error {
	cmd := c.newCommand("peek", "peek --topic T [--group G] [--limit N] [--json]",
		"  pgoutbox peek --topic orders.placed\n  pgoutbox peek --topic orders.placed --group billing --limit 5 --json\n", true)
	cmd.inspects = true
	topic := cmd.fs.String("topic", "", "the topic (required)")
	group := cmd.fs.String("group", "", "the consumer group (default: the default group)")
	limit := cmd.fs.Int("limit", 20, fmt.Sprintf("at most this many messages, next due first (up to %d)", pgoutbox.MaxPeekLimit))
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	if err := cmd.limitInRange(*limit, pgoutbox.MaxPeekLimit); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		var opts []pgoutbox.PeekOption
		if !cmd.json {
			// The table shows a line of each payload: not megabytes of
			// large ones.
			opts = append(opts, pgoutbox.PeekPayloadPrefix(peekPreviewBytes))
		}
		msgs, err := pgoutbox.Peek(ctx, exec, tables, *topic, *group, *limit, opts...)
		if err != nil {
			return err
		}
		if cmd.json {
			out := struct {
				Topic         string        `json:"topic"`
				ConsumerGroup string        `json:"consumer_group"`
				Messages      []pendingJSON `json:"messages"`
			}{Topic: *topic, ConsumerGroup: *group, Messages: []pendingJSON{}}
			for _, m := range msgs {
				j := pendingJSON{ID: m.ID, UUID: m.UUID, Metadata: metadataMap(m.Metadata), jsonPayload: payloadJSON(m.Payload),
					CreatedAt: m.CreatedAt, Parked: m.Parked, Deliveries: m.Deliveries, DedupKey: m.DedupKey,
					OrderingKey: m.OrderingKey, LastError: m.LastError, FailureReason: m.FailureReason}
				if !m.Parked {
					at := m.AvailableAt
					j.AvailableAt = &at
				}
				out.Messages = append(out.Messages, j)
			}
			return writeJSON(c.stdout, out)
		}
		if len(msgs) == 0 {
			fmt.Fprintf(c.stdout, "no pending messages on %q for group %s\n", *topic, groupName(*group))
			c.noteUnbound(ctx, exec, tables, *topic, *group, "") // "drained" or mistyped
			return nil
		}
		// A KEY column when any message has an ordering key: what a
		// blocked key's messages wait behind.
		keyed := slices.ContainsFunc(msgs, func(m pgoutbox.PendingMessage) bool { return m.OrderingKey != "" })
		tw := newTable(c.stdout)
		if keyed {
			fmt.Fprintln(tw, "ID\tUUID\tKEY\tDUE\tDELIVERIES\tPAYLOAD")
		} else {
			fmt.Fprintln(tw, "ID\tUUID\tDUE\tDELIVERIES\tPAYLOAD")
		}
		for _, m := range msgs {
			due := listTime(m.AvailableAt)
			if m.Parked {
				due = "parked (" + m.FailureReason + ")"
			}
			p := fmt.Sprintf("(%d bytes)", m.PayloadSize)
			if s := payloadJSON(payloadcut.Trim(m.Payload, m.PayloadSize)); s.Payload != nil {
				p = short(*s.Payload, 60)
				if len(m.Payload) < m.PayloadSize && !strings.HasSuffix(p, "…") {
					p += "…" // a start that fits: it still goes on
				}
			}
			if keyed {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%s\t%d\t%s\n", m.ID, m.UUID, m.OrderingKey, due, m.Deliveries, p)
			} else {
				fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%s\n", m.ID, m.UUID, due, m.Deliveries, p)
			}
		}
		return tw.Flush()
	})
}

// peekPreviewBytes is how much of each payload the peek table reads: its
// column shows 60 characters of it, blanks collapsed.
const peekPreviewBytes = 1 << 10
