package cli

import (
	"crypto/tls"
	"flag"
	"fmt"
	"net/http"
	"os"
	"time"

	"github.com/km0/km0/transport/amqp"
)

// AMQPTLSFlags are the TLS settings of an amqps:// --amqp-url, which the
// RabbitMQ management API (km0 lag, km0 console) is reached with too.
type AMQPTLSFlags struct {
	ca, cert, key, serverName *string
}

// AddAMQPTLSFlags registers --amqp-tls-ca-file, --amqp-tls-cert-file,
// --amqp-tls-key-file and --amqp-tls-server-name, defaulting to
// KM0_AMQP_TLS_CA_FILE, KM0_AMQP_TLS_CERT_FILE, KM0_AMQP_TLS_KEY_FILE and
// KM0_AMQP_TLS_SERVER_NAME. They hold paths and a name, no secret: the key
// stays in its file.
func AddAMQPTLSFlags(fs *flag.FlagSet) *AMQPTLSFlags {
	return &AMQPTLSFlags{
		ca: fs.String("amqp-tls-ca-file", os.Getenv("KM0_AMQP_TLS_CA_FILE"),
			"amqps://: PEM file of the CAs that sign RabbitMQ's certificate (default $KM0_AMQP_TLS_CA_FILE, else the system's roots)"),
		cert: fs.String("amqp-tls-cert-file", os.Getenv("KM0_AMQP_TLS_CERT_FILE"),
			"amqps://: client certificate (PEM), with --amqp-tls-key-file (default $KM0_AMQP_TLS_CERT_FILE)"),
		key: fs.String("amqp-tls-key-file", os.Getenv("KM0_AMQP_TLS_KEY_FILE"),
			"amqps://: key of --amqp-tls-cert-file (PEM; make it readable by this user only) (default $KM0_AMQP_TLS_KEY_FILE)"),
		serverName: fs.String("amqp-tls-server-name", os.Getenv("KM0_AMQP_TLS_SERVER_NAME"),
			"amqps://: the name RabbitMQ's certificate must hold, for the broker and its management API (default $KM0_AMQP_TLS_SERVER_NAME, else the URL's host)"),
	}
}

// Config loads the files: nil when no flag is set (an amqps:// URL then
// verifies with the system's roots). Errors name the flag and the file.
func (f *AMQPTLSFlags) Config() (*tls.Config, error) {
	files := amqp.TLSFiles{CAFile: *f.ca, CertFile: *f.cert, KeyFile: *f.key, ServerName: *f.serverName}
	if files.IsZero() {
		return nil, nil
	}
	cfg, err := files.Config()
	if err != nil {
		return nil, fmt.Errorf("--amqp-tls-*: %w", err)
	}
	return cfg, nil
}

// ManagementClient is the HTTP client of the management API: a 5 s timeout,
// and tlsCfg for an https:// API (nil: the system's roots).
func ManagementClient(tlsCfg *tls.Config) *http.Client {
	c := &http.Client{Timeout: 5 * time.Second}
	if tlsCfg != nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.TLSClientConfig = tlsCfg.Clone()
		c.Transport = tr
	}
	return c
}
