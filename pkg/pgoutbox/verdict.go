package pgoutbox

import (
	"maps"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/components/delay"
	"github.com/ThreeDotsLabs/watermill/message"
)

// maxErrorLen bounds last_error: some errors carry whole request bodies, and
// a poison row should not make every write of it, or the DLQ, heavy.
const maxErrorLen = 8 << 10

const truncatedMarker = "…[truncated]"

// nacked decides what a Nack means for d: dead-letter it (rejected, or the
// retry policy gives up) or return it to be due again after a delay. A
// delay set on the message by Watermill's DelayOnError wins over the
// policy's, and changed metadata is stored, so DelayOnError's multiplier
// (which reads the "delayed for" key) grows across redeliveries.
func (sub *subscription) nacked(d *delivery, msg *message.Message) {
	rejectReason, handlerErr := d.outcome.get()
	errText := ""
	if handlerErr != nil {
		errText = boundError(handlerErr.Error())
	}
	if rejectReason != "" {
		if errText == "" {
			errText = boundError("rejected: " + rejectReason)
		}
		sub.comp.deadLetter(d, ReasonRejected, errText)
		return
	}
	after, retry := sub.cfg.RetryPolicy.NextDelay(d.deliveries, handlerErr)
	if !retry {
		sub.comp.deadLetter(d, ReasonRetryExhausted, errText)
		return
	}
	var meta []byte
	stored := message.Metadata{}
	if decodeMetadata(d.metaRaw, stored) == nil {
		delete(stored, delay.DelayedUntilKey) // as handed out (delivery.message)
		if !maps.Equal(stored, msg.Metadata) {
			meta, _ = appendMetadataJSON(nil, 0, sanitizeMetadata(msg.Metadata))
		}
	}
	// The message was handed out without a "delayed until" key, so one now
	// means the handler's side (Watermill's DelayOnError, or delay.Message)
	// chose when to retry: its duration wins over the policy's delay.
	if _, ok := msg.Metadata[delay.DelayedUntilKey]; ok {
		if dd, err := time.ParseDuration(msg.Metadata.Get(delay.DelayedForKey)); err == nil {
			after = dd
		}
	}
	sub.comp.retry(d, after, errText, meta)
}

// sanitizeText makes s storable as PostgreSQL text: invalid UTF-8 becomes
// U+FFFD and NUL bytes are dropped. Text the subscriber writes on its own
// (handler errors, metadata a handler changed) must never fail the batched
// statement it travels in, or one bad message would stop every ack.
func sanitizeText(s string) string {
	s = strings.ToValidUTF8(s, "\uFFFD")
	return strings.ReplaceAll(s, "\x00", "")
}

func sanitizeMetadata(md message.Metadata) message.Metadata {
	out := make(message.Metadata, len(md))
	for k, v := range md {
		out[sanitizeText(k)] = sanitizeText(v)
	}
	return out
}

// boundError makes s storable (sanitizeText) and cuts it to maxErrorLen
// bytes at a rune boundary, marking the cut.
func boundError(s string) string {
	s = sanitizeText(s)
	if len(s) <= maxErrorLen {
		return s
	}
	cut := maxErrorLen - len(truncatedMarker)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + truncatedMarker
}

// logWarn logs at WARN where the logger has that level; Watermill's
// LoggerAdapter has none, so others get INFO with severity=warn.
func logWarn(l watermill.LoggerAdapter, msg string, fields watermill.LogFields) {
	if w, ok := l.(interface {
		Warn(string, watermill.LogFields)
	}); ok {
		w.Warn(msg, fields)
		return
	}
	l.Info(msg, fields.Add(watermill.LogFields{"severity": "warn"}))
}
