package pgoutboxui

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// CSRF protection, double submit: the browser holds a random nonce in a
// cookie (HttpOnly, SameSite=Strict, scoped to BasePath); every form
// carries the nonce and its HMAC under the handler's random secret. A POST
// passes only when its form token is signed by this handler and names the
// nonce of the cookie sent with it: another site can neither read the
// cookie nor the page holding the token, and cannot make up a signature.
// Browsers' Origin and Sec-Fetch-Site headers are checked too, where sent.

const csrfCookie = "pgoutbox_csrf"

// csrfToken returns the form token of the request's nonce, setting a new
// nonce cookie when the request has none.
func (ui *UI) csrfToken(w http.ResponseWriter, r *http.Request) string {
	if !ui.opts.Writes {
		return ""
	}
	nonce := ""
	if c, err := r.Cookie(csrfCookie); err == nil && validNonce(c.Value) {
		nonce = c.Value
	} else {
		b := make([]byte, 16)
		_, _ = rand.Read(b)
		nonce = hex.EncodeToString(b)
		http.SetCookie(w, &http.Cookie{Name: csrfCookie, Value: nonce, Path: ui.opts.BasePath,
			HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
		// The page rendered now must see it as the request's own.
		r.AddCookie(&http.Cookie{Name: csrfCookie, Value: nonce})
	}
	return nonce + "." + ui.sign(nonce)
}

func (ui *UI) sign(nonce string) string {
	m := hmac.New(sha256.New, ui.secret)
	m.Write([]byte("pgoutboxui csrf\x00" + nonce))
	return hex.EncodeToString(m.Sum(nil))
}

func validNonce(s string) bool {
	if len(s) != 32 {
		return false
	}
	_, err := hex.DecodeString(s)
	return err == nil
}

// checkCSRF reports why a POST is refused, or "" when it passes.
func (ui *UI) checkCSRF(r *http.Request) string {
	site := r.Header.Get("Sec-Fetch-Site")
	if site == "cross-site" {
		return "the request came from another site"
	}
	// A browser that says same-origin has compared the origins itself. A
	// reverse proxy in front may have rewritten Host to its upstream's
	// (nginx's default): the host the browser saw is then the forwarded
	// one, which a cross-site form cannot set.
	if o := r.Header.Get("Origin"); o != "" && o != "null" && site != "same-origin" {
		u, err := url.Parse(o)
		if err != nil || !sameHost(u.Host, r) {
			return fmt.Sprintf("the request's Origin (%s) is neither the Host it was sent to (%s) nor a forwarded one: "+
				"another site, or a reverse proxy in front that rewrites Host without passing it on (nginx: proxy_set_header Host $http_host, or X-Forwarded-Host)",
				o, r.Host)
		}
	}
	c, err := r.Cookie(csrfCookie)
	if err != nil || !validNonce(c.Value) {
		return "the CSRF cookie is missing (cookies disabled, or the page was opened elsewhere); reload the page and try again"
	}
	nonce, sig, ok := strings.Cut(r.PostFormValue("csrf"), ".")
	if !ok || nonce != c.Value || !hmac.Equal([]byte(sig), []byte(ui.sign(nonce))) {
		return "the CSRF token does not match; reload the page and try again"
	}
	return ""
}

// sameHost reports whether host is the request's Host, or the host a proxy
// in front forwarded it for (X-Forwarded-Host, Forwarded: host=).
func sameHost(host string, r *http.Request) bool {
	if strings.EqualFold(host, r.Host) {
		return true
	}
	for _, v := range r.Header.Values("X-Forwarded-Host") {
		for _, h := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(h), host) {
				return true
			}
		}
	}
	for _, v := range r.Header.Values("Forwarded") {
		for _, elem := range strings.Split(v, ",") {
			for _, pair := range strings.Split(elem, ";") {
				k, val, ok := strings.Cut(strings.TrimSpace(pair), "=")
				if ok && strings.EqualFold(k, "host") && strings.EqualFold(strings.Trim(val, `"`), host) {
					return true
				}
			}
		}
	}
	return false
}
