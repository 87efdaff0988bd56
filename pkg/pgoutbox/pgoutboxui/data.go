package pgoutboxui

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/jackc/pgx/v5/pgtype"

	"github.com/pgoutbox/watermill-pgoutbox/internal/payloadcut"
	"github.com/pgoutbox/watermill-pgoutbox/internal/query"
	"github.com/pgoutbox/watermill-pgoutbox/pkg/pgoutbox"
)

// bindings reads every binding.
func (ui *UI) bindings(ctx context.Context) (map[pair]bool, error) {
	rows, err := ui.exec.Query(ctx, query.UIBindings(ui.names))
	if err != nil {
		return nil, fmt.Errorf("pgoutboxui: read bindings: %w", err)
	}
	defer rows.Close()
	out := map[pair]bool{}
	for rows.Next() {
		var p pair
		if err := rows.Scan(&p.topic, &p.group); err != nil {
			return nil, fmt.Errorf("pgoutboxui: read bindings: %w", err)
		}
		out[p] = true
	}
	return out, rows.Err()
}

// deadLettersByID reads the dead letters with ids (those that exist), the
// first prefix bytes of each payload (0: all).
func (ui *UI) deadLettersByID(ctx context.Context, ids []int64, prefix int) ([]pgoutbox.DeadLetter, error) {
	if ui.names.QDLQ == "" {
		return nil, badRequest("this outbox has no dead-letter table")
	}
	rows, err := ui.exec.Query(ctx, query.UIDeadLettersByID(ui.names), ids, prefix)
	if err != nil {
		return nil, fmt.Errorf("pgoutboxui: read dead letters: %w", err)
	}
	defer rows.Close()
	var out []pgoutbox.DeadLetter
	for rows.Next() {
		var d pgoutbox.DeadLetter
		var md string
		var dedup, lastErr, failedBy, okey *string
		if err := rows.Scan(&d.ID, &d.Topic, &d.ConsumerGroup, &d.UUID, &d.Payload, &d.PayloadSize, &md, &d.CreatedAt, &d.Deliveries,
			&dedup, &lastErr, &d.FailureReason, &failedBy, &d.FailedAt, &okey); err != nil {
			return nil, fmt.Errorf("pgoutboxui: read dead letters: %w", err)
		}
		d.DedupKey, d.LastError, d.FailedBy, d.OrderingKey = deref(dedup), deref(lastErr), deref(failedBy), deref(okey)
		d.Metadata = map[string]string{}
		var raw map[string]any
		if err := json.Unmarshal([]byte(md), &raw); err == nil {
			for k, v := range raw {
				if s, ok := v.(string); ok {
					d.Metadata[k] = s
				} else {
					b, _ := json.Marshal(v)
					d.Metadata[k] = string(b)
				}
			}
		}
		out = append(out, d)
	}
	return out, rows.Err()
}

func deref(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

// countDeadLetters counts the dead letters f matches (After and Limit
// ignored).
func (ui *UI) countDeadLetters(ctx context.Context, f pgoutbox.DeadLetterFilter) (int64, error) {
	if ui.names.QDLQ == "" {
		return 0, badRequest("this outbox has no dead-letter table")
	}
	ts := func(t time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: t, Valid: !t.IsZero()} }
	text := func(s string, ok bool) pgtype.Text { return pgtype.Text{String: s, Valid: ok} }
	group := text("", false)
	if f.ConsumerGroup != nil {
		group = text(*f.ConsumerGroup, true)
	}
	var n int64
	rows, err := ui.exec.Query(ctx, query.UICountDeadLetters(ui.names, f.Topic != ""),
		text(f.Topic, f.Topic != ""), group, text(f.Reason, f.Reason != ""), ts(f.FailedAfter), ts(f.FailedBefore),
		pgtype.Timestamptz{}, int64(0))
	if err != nil {
		return 0, fmt.Errorf("pgoutboxui: count dead letters: %w", err)
	}
	defer rows.Close()
	if rows.Next() {
		err = rows.Scan(&n)
	}
	if err == nil {
		err = rows.Err()
	}
	return n, err
}

// blockedKey is the head of an ordering key that has failed repeatedly.
type blockedKey struct {
	Key         string
	HeadID      int64
	Deliveries  int
	AvailableAt time.Time
	Leased      bool
	LastError   string
	Behind      int64
}

func (ui *UI) blockedKeys(ctx context.Context, topic, group string, limit int) ([]blockedKey, error) {
	rows, err := ui.exec.Query(ctx, query.UIBlockedKeys(ui.names), topic, group, ui.opts.BlockedDeliveries, limit)
	if err != nil {
		return nil, fmt.Errorf("pgoutboxui: blocked ordering keys: %w", err)
	}
	defer rows.Close()
	var out []blockedKey
	for rows.Next() {
		var k blockedKey
		if err := rows.Scan(&k.Key, &k.HeadID, &k.Deliveries, &k.AvailableAt, &k.Leased, &k.LastError, &k.Behind); err != nil {
			return nil, fmt.Errorf("pgoutboxui: blocked ordering keys: %w", err)
		}
		out = append(out, k)
	}
	return out, rows.Err()
}

// payloadView is a payload shown for people: JSON pretty-printed, text as
// is, anything else as hex and base64.
type payloadView struct {
	Kind   string // "json", "text", "binary", "empty"
	Text   string
	Hex    string
	Base64 string
	Size   int
}

// maxShownPayload bounds the payload text a page shows; listPayloadPrefix
// and previewPrefix are how much of each payload the pages with many rows
// read (pgoutbox.PeekPayloadPrefix, DeadLetterFilter.PayloadPrefix): a
// page of large messages reads a few MB, not each message whole.
const (
	maxShownPayload   = 64 << 10
	listPayloadPrefix = maxShownPayload
	previewPrefix     = 1 << 10
)

// viewPayload shows p, a payload of size bytes in all: all of it, or its
// start when it was read by prefix.
func viewPayload(p []byte, size int) payloadView {
	cut := len(p) < size
	text := payloadcut.Trim(p, size) // binary is shown as it was read
	clip := func(s string) string {
		if cut {
			return clipTo(s, size) // says the payload's size
		}
		return clipTo(s, len(s))
	}
	v := payloadView{Size: size}
	switch {
	case size == 0:
		v.Kind = "empty"
	case !cut && json.Valid(p):
		var buf bytes.Buffer
		if json.Indent(&buf, p, "", "  ") == nil {
			v.Kind, v.Text = "json", clip(buf.String())
		}
	case utf8.Valid(text) && printable(string(text)):
		v.Kind, v.Text = "text", clip(string(text))
	default:
		v.Kind = "binary"
		shown := p
		if len(shown) > 4096 {
			shown = shown[:4096]
		}
		v.Hex = hex.Dump(shown)
		v.Base64 = clip(base64.StdEncoding.EncodeToString(p))
	}
	return v
}

func printable(s string) bool {
	return strings.IndexFunc(s, func(r rune) bool {
		return unicode.IsControl(r) && r != '\n' && r != '\r' && r != '\t'
	}) < 0
}

// clipTo is s, the start of something of whole bytes, at most
// maxShownPayload of it, with a note of the whole's size when it is cut.
func clipTo(s string, whole int) string {
	if len(s) <= maxShownPayload && len(s) >= whole {
		return s
	}
	if len(s) > maxShownPayload {
		cut := maxShownPayload
		for cut > 0 && !utf8.RuneStart(s[cut]) {
			cut--
		}
		s = s[:cut]
	}
	return s + "\n… (cut: " + fmt.Sprint(whole) + " bytes in all)"
}

// preview is a one-line start of a payload of size bytes for a table; p
// is the payload or its start.
func preview(p []byte, size int) string {
	cut := len(p) < size
	p = payloadcut.Trim(p, size)
	if !utf8.Valid(p) || !printable(string(p)) {
		return fmt.Sprintf("(%d bytes of binary)", size)
	}
	s := strings.Join(strings.Fields(string(p)), " ")
	switch {
	case utf8.RuneCountInString(s) > 80:
		s = string([]rune(s)[:79]) + "…"
	case cut:
		s += "…" // a start that fits: it still goes on
	}
	return s
}
