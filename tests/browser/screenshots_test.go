package browser

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/chromedp/chromedp"
	"github.com/stretchr/testify/require"

	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// TestScreenshots writes the screenshots of docs/ui.md into the directory
// PGOUTBOX_SCREENSHOTS names (make ui-screenshots): an outbox with a few
// services, consumers working through bursts for a few seconds so the
// charts have a shape, dead letters, a paused group, a blocked key and a
// stranded group. It skips without the variable.
func TestScreenshots(t *testing.T) {
	dir := os.Getenv("PGOUTBOX_SCREENSHOTS")
	if dir == "" {
		t.Skip("set PGOUTBOX_SCREENSHOTS to a directory (make ui-screenshots) to write the screenshots")
	}
	b := setup(t)
	b.ui.Start()
	ctx := context.Background()
	exec := b.env.Exec()
	// The page's Observer in the consumers and the publisher: exact rates.
	pub, err := pgoutbox.NewPublisher(exec, pgoutbox.PublisherConfig{Tables: b.env.Tables, Observer: b.ui.Observer()}, nil)
	require.NoError(t, err)
	for _, bnd := range [][2]string{{"orders.placed", "billing"}, {"orders.placed", "shipping"}, {"orders.placed", "analytics"},
		{"payments.captured", "billing"}, {"users.signed_up", "crm"}} {
		require.NoError(t, pgoutbox.Bind(ctx, exec, b.env.Tables, bnd[0], bnd[1]))
	}
	// Rows of a group that was unbound: stranded.
	_, err = b.env.Pool.Exec(ctx, fmt.Sprintf(`INSERT INTO %s.%s (topic, consumer_group, uuid, payload, metadata, created_at, available_at)
SELECT 'orders.placed', 'legacy-reports', gen_random_uuid()::text, '{}', '{}', now() - interval '3 days', now() - interval '3 days' FROM generate_series(1, 37)`,
		b.env.Schema, b.env.Tables.Table))
	require.NoError(t, err)

	var wg sync.WaitGroup
	stop := make(chan struct{})
	consume := func(topic, group string, pace time.Duration, fail func(*message.Message) bool) {
		sub := b.env.NewSubscriber(t, func(c *pgoutbox.SubscriberConfig) {
			c.ConsumerGroup = group
			c.RetryPolicy = pgoutbox.NoRetry()
			c.Observer = b.ui.Observer()
			c.WorkerID = group + "-7d9f4c:1:" + watermill.NewShortUUID()[:8]
		})
		ch, err := sub.Subscribe(ctx, topic)
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				case m := <-ch:
					time.Sleep(pace) // a handler's work
					if fail != nil && fail(m) {
						m.Nack()
					} else {
						m.Ack()
					}
				}
			}
		}()
	}
	n := 0
	var mu sync.Mutex
	consume("orders.placed", "billing", 4*time.Millisecond, func(m *message.Message) bool {
		mu.Lock()
		defer mu.Unlock()
		n++
		return n%40 == 0 // now and then a payment fails for good
	})
	consume("orders.placed", "analytics", 12*time.Millisecond, nil)
	consume("payments.captured", "billing", 2*time.Millisecond, nil)
	consume("users.signed_up", "crm", 3*time.Millisecond, nil)
	require.NoError(t, pgoutbox.PauseGroup(ctx, exec, b.env.Tables, "orders.placed", "shipping"))

	order := func(i int) *message.Message {
		m := message.NewMessage(watermill.NewUUID(), []byte(fmt.Sprintf(`{"order_id":"ord_%05d","customer":"cus_%03d","total":{"amount":%d,"currency":"EUR"},"items":[{"sku":"BOOK-42","qty":1}]}`, i, i%97, 1000+i*7%9000)))
		m.Metadata.Set("trace_id", fmt.Sprintf("4bf92f3577b34da6a3ce929d0e0e%04d", i))
		m.Metadata.Set("source", "checkout-service")
		pgoutbox.WithOrderingKey(m, fmt.Sprintf("cus_%03d", i%97))
		return m
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for round := 0; ; round++ {
			var batch []*message.Message
			for i := range 10 + (round%6)*15 {
				batch = append(batch, order(round*1000+i))
			}
			if pub.Publish("orders.placed", batch...) != nil || pub.Publish("payments.captured", msgs(5+round%4*5, "payment")...) != nil ||
				pub.Publish("users.signed_up", msgs(3, "user")...) != nil {
				return
			}
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Millisecond): // publishing paced over the charts' span
			}
		}
	}()
	defer func() {
		close(stop)
		wg.Wait()
	}()
	time.Sleep(8 * time.Second) // the charts' span

	// A blocked key: its head failed five times and waits for a retry.
	head := order(99999)
	pgoutbox.WithOrderingKey(head, "cus_blocked")
	behind := order(99998)
	pgoutbox.WithOrderingKey(behind, "cus_blocked")
	require.NoError(t, pub.Publish("orders.placed", head, behind))
	_, err = b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET deliveries = 5, available_at = now() + interval '4 minutes',
  last_error = 'payments: POST /v1/charges: 502 Bad Gateway (upstream timeout after 30s)' WHERE uuid = $1`, b.env.Schema, b.env.Tables.Table), head.UUID)
	require.NoError(t, err)
	_, err = b.env.Pool.Exec(ctx, fmt.Sprintf(`UPDATE %s.%s SET last_error = 'payments: card declined (insufficient_funds)', failure_reason = 'rejected'`,
		b.env.Schema, b.env.Tables.DeadLetterTable))
	require.NoError(t, err)
	time.Sleep(500 * time.Millisecond) // two more samples

	require.NoError(t, os.MkdirAll(dir, 0o755))
	shot := func(name, path string, prepare ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		b.open(t, path)
		require.NoError(t, chromedp.Do(b.ctx, prepare...))
		png, err := chromedp.Run(b.ctx, chromedp.CaptureScreenshot())
		require.NoError(t, err)
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), png, 0o644))
	}
	require.NoError(t, chromedp.Do(b.ctx, chromedp.EmulateViewport(1360, 900)))
	shot("ui-overview.png", "")
	shot("ui-group.png", "group?topic=orders.placed&group=billing",
		chromedp.Evaluate[chromedp.Void](`document.querySelector('details.msg') && (document.querySelector('details.msg').open = true); window.scrollTo(0, 0)`))
	shot("ui-dead-letters.png", "dead-letters")
	page, err := pgoutbox.DeadLetters(ctx, exec, b.env.Tables, pgoutbox.DeadLetterFilter{Limit: 1})
	require.NoError(t, err)
	require.NotEmpty(t, page.Letters, "the billing consumer dead-lettered some orders")
	shot("ui-dead-letter.png", fmt.Sprintf("dead-letter?id=%d", page.Letters[0].ID))
	b.open(t, "group?topic=orders.placed&group=analytics")
	b.click(t, "#pause-button")
	png, err := chromedp.Run(b.ctx, chromedp.CaptureScreenshot())
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, "ui-confirm.png"), png, 0o644))
}
