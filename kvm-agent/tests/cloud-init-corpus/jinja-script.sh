## template: jinja
#!/bin/sh
echo "{{ v1.instance_id }}" > /run/egress-id
