// Tries to grant User:intruder every operation on every topic through Kafka's own Admin
// client: args are client properties as key value pairs (bootstrap.servers or
// bootstrap.controllers first). Prints GRANTED or REFUSED with the reason. Used by
// tests/service/test_security.py, run with `java -cp <kafka classpath> GrantAcl.java`.
import java.util.List;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.common.acl.AccessControlEntry;
import org.apache.kafka.common.acl.AclBinding;
import org.apache.kafka.common.acl.AclOperation;
import org.apache.kafka.common.acl.AclPermissionType;
import org.apache.kafka.common.resource.PatternType;
import org.apache.kafka.common.resource.ResourcePattern;
import org.apache.kafka.common.resource.ResourceType;

public class GrantAcl {
    public static void main(String[] args) {
        Properties props = new Properties();
        for (int i = 0; i + 1 < args.length; i += 2) {
            props.put(args[i], args[i + 1]);
        }
        props.put("request.timeout.ms", "5000");
        props.put("default.api.timeout.ms", "10000");
        props.put("reconnect.backoff.max.ms", "1000");
        AclBinding everything = new AclBinding(
            new ResourcePattern(ResourceType.TOPIC, "*", PatternType.LITERAL),
            new AccessControlEntry("User:intruder", "*", AclOperation.ALL, AclPermissionType.ALLOW));
        try (Admin admin = Admin.create(props)) {
            admin.createAcls(List.of(everything)).all().get();
            System.out.println("GRANTED");
        } catch (Exception e) {
            Throwable cause = e.getCause() != null ? e.getCause() : e;
            System.out.println("REFUSED " + cause.getClass().getSimpleName() + ": " + cause.getMessage());
        }
    }
}
