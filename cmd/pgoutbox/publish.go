package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/schema"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox/tx"
)

func (c *cli) publishCmd(args []string) error {
	cmd := c.newCommand("publish", "publish --topic T [--payload S | --payload-file F] [--metadata k=v ...] [--delay DUR] [--dedup-key K] [--ordering-key K] [--max-payload-bytes N] [--json]",
		`  pgoutbox publish --topic orders.placed --payload '{"id":42}'
  pgoutbox publish --topic orders.placed --payload-file order.json --metadata source=cli --delay 30s
  echo '{"id":7}' | pgoutbox publish --topic orders.placed --payload-file -
`, true)
	topic := cmd.fs.String("topic", "", "the topic (required)")
	payload := cmd.fs.String("payload", "", "the payload")
	payloadFile := cmd.fs.String("payload-file", "", "read the payload from this file (- for stdin)")
	maxPayload := cmd.fs.Int("max-payload-bytes", 0, "the largest payload to publish, as PublisherConfig.MaxPayloadBytes: 0 for its default (1 MiB), -1 for no limit")
	var md pairList
	cmd.fs.Var(&md, "metadata", "a metadata entry key=value (repeat for more)")
	delay := cmd.durationVar("delay", 0, "deliver after this `duration` (30s, 5m)")
	dedup := cmd.fs.String("dedup-key", "", "dedup key: skipped if a pending message of the topic has it")
	ordering := cmd.fs.String("ordering-key", "", "ordering key: delivered in order with the other messages of the key")
	uuid := cmd.fs.String("uuid", "", "message UUID (default: a new one)")
	if err := cmd.parseNoArgs(args); err != nil {
		return err
	}
	if err := cmd.required("topic", *topic); err != nil {
		return err
	}
	if *payload != "" && *payloadFile != "" {
		return usagef(cmd.name, "--payload and --payload-file do not go together; pick one")
	}
	if *delay < 0 {
		return usagef(cmd.name, "--delay %s is negative; use a positive duration", *delay)
	}
	body := []byte(*payload)
	var err error
	switch *payloadFile {
	case "":
	case "-":
		if body, err = readAll(c.stdin); err != nil {
			return fmt.Errorf("read the payload from stdin: %w", err)
		}
	default:
		if body, err = os.ReadFile(*payloadFile); err != nil {
			return fmt.Errorf("read the payload: %w; check --payload-file", err)
		}
	}
	id := *uuid
	if id == "" {
		id = watermill.NewUUID()
	}
	msg := message.NewMessage(id, body)
	for _, kv := range md {
		msg.Metadata.Set(kv[0], kv[1])
	}
	if *delay > 0 {
		pgoutbox.DeliverAfter(msg, *delay)
	}
	if *dedup != "" {
		pgoutbox.WithDedupKey(msg, *dedup)
	}
	if *ordering != "" {
		pgoutbox.WithOrderingKey(msg, *ordering)
	}
	return cmd.withOutbox(msg.Context(), nil, func(ctx context.Context, exec tx.Executor, tables schema.Config) error {
		pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: tables, StatementTimeout: 10 * time.Second, MaxPayloadBytes: *maxPayload}, nil)
		if err != nil {
			return err
		}
		defer pub.Close()
		res, err := pub.PublishWithResult(*topic, msg)
		if err != nil {
			return err
		}
		skipped := len(res.Skipped()) > 0
		if cmd.json {
			return writeJSON(c.stdout, map[string]any{"topic": *topic, "uuid": id, "id": res.IDs[0], "skipped": skipped})
		}
		if skipped {
			fmt.Fprintf(c.stdout, "skipped: a pending message of %q already has dedup key %q\n", *topic, *dedup)
			return nil
		}
		fmt.Fprintf(c.stdout, "published %s to %q (row id %d)\n", id, *topic, res.IDs[0])
		return nil
	})
}
