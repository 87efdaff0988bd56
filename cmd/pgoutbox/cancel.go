package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

// errNothingCancelled ends a cancel that found no message to cancel: exit
// code 1, as for any command with nothing to act on.
var errNothingCancelled = errors.New("nothing cancelled")

// errPartlyCancelled is a cancel that found a copy being delivered and
// cancelled the others.
var errPartlyCancelled = errors.New("not all cancelled")

func (c *cli) cancelCmd(args []string) error {
	cmd := c.newCommand("cancel", "cancel --topic T --dedup-key K [--json]",
		"  pgoutbox cancel --topic reminders --dedup-key order-42-reminder\n", true)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	key := cmd.fs.String("dedup-key", "", "the dedup key the message was published with (required)")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	if err := cmd.required("dedup-key", *key); err != nil {
		return err
	}
	return cmd.withOutbox(context.Background(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: tables, StatementTimeout: 10 * time.Second}, nil)
		if err != nil {
			return err
		}
		defer pub.Close()
		r, err := pub.CancelScheduledCopies(ctx, *topic, *key)
		if err != nil {
			return err
		}
		ok := r.Cancelled > 0 && r.Delivering == 0
		if cmd.json {
			if err := writeJSON(c.stdout, map[string]any{"topic": *topic, "dedup_key": *key, "cancelled": ok,
				"copies_cancelled": r.Cancelled, "copies_delivering": r.Delivering}); err != nil {
				return err
			}
		} else if ok {
			fmt.Fprintf(c.stdout, "cancelled the message of %q with dedup key %q\n", *topic, *key)
		}
		switch {
		case r.Delivering > 0 && r.Cancelled > 0:
			return fmt.Errorf("%w: the message of %q with dedup key %q is being delivered in %d consumer group(s), where it completes; its %d waiting copies in other groups were cancelled",
				errPartlyCancelled, *topic, *key, r.Delivering, r.Cancelled)
		case r.Delivering > 0:
			return fmt.Errorf("%w: the message of %q with dedup key %q is being delivered in %d consumer group(s), where it completes",
				errNothingCancelled, *topic, *key, r.Delivering)
		case !ok:
			return fmt.Errorf("%w: no message of %q with dedup key %q is waiting (never published, already delivered, or being delivered now: see \"pgoutbox peek --topic %s\")",
				errNothingCancelled, *topic, *key, *topic)
		}
		return nil
	})
}
